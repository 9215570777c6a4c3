"""The command line: ``positronic-brain run|chat|bench|replay|fork|compare|inspect|compose|
export|transfer|calibrate``.

``args`` builds the parser and the parameter objects, ``commands`` runs the one-shot
commands, ``chat_repl`` the chat. Bad input gets one line on stderr and exit code 2, never
a traceback, and leaves no folder or capture that the refused command made for nothing
(``plain.take_back``).
"""
from __future__ import annotations

import sys

from ..plain import arm, take_back
from ..types import UserError
from .args import PROG, build_parser
from .chat_repl import cmd_chat
from .commands import (cmd_bench, cmd_calibrate, cmd_compare, cmd_compose, cmd_export,
                       cmd_fork, cmd_inspect, cmd_replay, cmd_run, cmd_transfer)

COMMANDS = {"run": cmd_run, "bench": cmd_bench, "replay": cmd_replay, "fork": cmd_fork,
            "compare": cmd_compare, "inspect": cmd_inspect, "chat": cmd_chat,
            "compose": cmd_compose, "export": cmd_export, "transfer": cmd_transfer,
            "calibrate": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    arm()
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UserError as e:  # with the folders and captures it made for nothing taken back
        take_back()
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130

