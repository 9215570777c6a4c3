"""The chat: turns are exactly the ChatML a fresh prime would cache, the cache holds its budget
turn after turn with the system prompt pinned, whole-turn pruning keeps whole turns (and HF
agrees on the pruned cache), sessions round-trip, and the CLI's script mode works end to end."""
import json

import pytest

from positronic_brain.chat import Chat
from positronic_brain.cli import main
from positronic_brain.replay import replay
from positronic_brain.sampler import make_generator
from positronic_brain.session_io import load_session, save_session
from positronic_brain.special_tokens import TokenPolicy
from positronic_brain.stages.generate import generate
from positronic_brain.state import FLAG_PROTECTED
from positronic_brain.types import CacheParams, SamplerParams, UserError
from tests.oracle import assert_close, hf_step_logits
from tests.tolerance import ORACLE

GREEDY = SamplerParams(greedy=True)
SAMPLED = SamplerParams(temperature=1.0, seed=5)
SYSTEM = "Be brief."


def _ids(policy, turns) -> list[int]:
    """ChatML built by hand from plain strings: no template, no BOS, nothing implicit."""
    enc, out = policy.encode, []
    for role, content in turns:
        body = enc(content) if isinstance(content, str) else list(content)
        out += enc(f"<|im_start|>{role}\n") + body + enc("<|im_end|>\n")
    return out


def _ledger(chat):
    return chat.session.state.ledger.rows()


def test_cached_ids_are_a_fresh_prime_of_the_conversation(real_model, real_policy):
    """No implicit system prompt or BOS; a reply that stopped at <|im_end|> keeps the model's
    own token, a reply cut short gets the marker added; every token tagged with its role."""
    chat = Chat(real_model, real_policy, sampler=GREEDY, max_new_tokens=40)
    chat.say("What is the capital of France?")
    assert chat.last.stop_reason == "eos" and "Paris" in chat.last.text
    chat.max_new_tokens = 3
    chat.say("Describe the Eiffel Tower in detail.")
    assert chat.last.stop_reason == "max_new_tokens" and len(chat.last.ids) == 3
    chat.max_new_tokens = 8
    events = chat.stream("And of Italy?")
    first = next(events)  # one step: the whole turn is cached now
    turns = chat.transcript
    assert [r for r, _ in turns] == ["user", "assistant", "user", "assistant", "user"]
    expected = _ids(real_policy, turns) + real_policy.encode("<|im_start|>assistant\n")
    assert chat.context_ids() == expected + [first.record.token_id]
    assert expected == [i for s in real_policy.chat(turns) for i in s.ids]
    text = real_policy.decode(expected)
    assert text.startswith("<|im_start|>user\n") and "system" not in text
    start = real_policy.encode("<|im_start|>")  # (SmolLM2's BOS is this very token)
    assert [i for i in expected if i in start] == start * (len(turns) + 1)  # no extra BOS
    roles = [r["source"] for r in _ledger(chat)]
    segments = real_policy.chat(turns)
    assert roles == [s.source for s in segments for _ in s.ids]
    assert chat.session.state.pending_source == "assistant"


def test_the_system_prompt_is_exactly_the_given_one_and_pinned(tiny_model, tiny_policy):
    chat = Chat(tiny_model, tiny_policy, system=SYSTEM, sampler=SAMPLED, max_new_tokens=4)
    chat.say("hi")
    system = _ids(tiny_policy, [("system", SYSTEM)])
    ledger = _ledger(chat)
    assert [r["token_id"] for r in ledger[:len(system)]] == system
    assert {r["source"] for r in ledger[:len(system)]} == {"system"}
    assert chat.context_ids()[len(system):len(system) + 2] == tiny_policy.encode("<|im_start|>u")
    state = chat.session.state
    pinned = (state.ledger.live("flags") & FLAG_PROTECTED) != 0
    assert int(pinned.sum()) == len(system)


def _turn_starts(policy, turns) -> list[int]:
    """Offsets of each user turn in the hand-built ids of ``turns``."""
    starts, at = [], 0
    for role, content in turns:
        if role == "user":
            starts.append(at)
        at += len(_ids(policy, [(role, content)]))
    return starts


@pytest.mark.parametrize("prune", ["token", "turns"])
def test_a_scripted_chat_holds_the_budget(tiny_model, tiny_policy, one_thread, prune):
    """30 turns at budget 64 on a model with 512 positions: every step the state is valid,
    the cache within the budget, positions in range (re-indexed), the system prompt whole;
    pruning turns, the text after it is always whole turns, the newest ones."""
    budget = 64
    cache = CacheParams(budget=budget, sinks=2, recent=4, allocation=prune)
    chat = Chat(tiny_model, tiny_policy, system=SYSTEM, sampler=SAMPLED, cache_params=cache,
                max_new_tokens=12)
    system = _ids(tiny_policy, [("system", SYSTEM)])
    limit = tiny_model.spec.max_positions
    for t in range(30):
        for ev in chat.stream(f"hi {t}"):
            state = chat.session.state
            state.check_valid()
            assert ev.record.cache_len == state.arena.n <= budget
            assert state.next_position < limit
        ledger = _ledger(chat)
        assert [r["token_id"] for r in ledger[:len(system)]] == system
        assert all(r["source"] == "system" for r in ledger[:len(system)])
        if prune == "turns":
            turns = chat.transcript[1:]
            full = _ids(tiny_policy, turns)
            ctx = chat.context_ids()[len(system):]
            # the pending token ends the last reply: <|im_end|>, or its last token if cut short
            end = len(full) - (1 if chat.last.stop_reason == "eos" else 2)
            start = end - len(ctx)
            assert start in _turn_starts(tiny_policy, turns), (t, start)
            assert ctx == full[start:end]
    stats = chat.stats()
    assert stats["turns"] == 30 and stats["reindexed"] >= 1 and stats["culled"] > 0
    assert stats["max_position"] < limit


def test_turn_pruning_gives_hf_logits_on_the_pruned_cache(real_model, real_policy):
    """The first step that drops whole turns: stage 1 over the pruned cache equals HF's forward
    over the same live K/V (fp32), and what was dropped is the oldest whole turn."""
    cache = CacheParams(budget=60, allocation="turns")
    chat = Chat(real_model, real_policy, system=SYSTEM, sampler=GREEDY, cache_params=cache,
                max_new_tokens=16)
    questions = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a city.",
                 "Name a river.", "Name a planet."]
    for q in questions:
        before = {r["uid"]: r for r in _ledger(chat)}
        for ev in chat.stream(q):
            if ev.record.culled:
                break
        else:
            continue
        dropped = sorted((before[u] for u in ev.record.culled), key=lambda r: r["position"])
        text = real_policy.decode([r["token_id"] for r in dropped])
        assert text.startswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant")
        assert {r["source"] for r in dropped} == {"user", "assistant"}
        view = chat.session.state.view()
        ours = generate(real_model, view, GREEDY, make_generator(0)).logits
        assert_close(ours, hf_step_logits(real_model, view), ORACLE, "logits after pruning")
        return
    pytest.fail("no turn was pruned")


def test_save_and_load_continue_identically(real_model, real_policy, tmp_path):
    cache = CacheParams(budget=40, sinks=2, recent=8)
    a = Chat(real_model, real_policy, system=SYSTEM, sampler=GREEDY, cache_params=cache,
             max_new_tokens=16)
    a.say("What is the capital of France?")
    a.say("And of Spain?")
    assert a.stats()["culled"] > 0
    save_session(a.session, tmp_path / "chat.pbs")
    b = Chat.resume(load_session(real_model, tmp_path / "chat.pbs"), max_new_tokens=16)
    assert b.context_ids() == a.context_ids()
    for q in ("And of Italy?", "Thanks!"):
        assert b.say(q) == a.say(q)
        assert b.last.ids == a.last.ids and b.context_ids() == a.context_ids()


def test_a_stop_token_other_than_the_end_of_turn_is_replaced(tiny_model):
    """A reply ending on another stop token: the next turn caches <|im_end|> in its place."""
    policy = TokenPolicy(tiny_model.tokenizer)
    newline = policy.encode("\n")[0]
    policy.eos_ids = policy.eos_ids | {newline}  # the tiny model's greedy choice
    chat = Chat(tiny_model, policy, sampler=GREEDY, max_new_tokens=4)
    chat.say("hi")
    assert chat.last.stop_reason == "eos" and chat.last.ids == ()
    events = chat.stream("again")
    first = next(events)
    expected = _ids(policy, chat.transcript) + policy.encode("<|im_start|>assistant\n")
    assert chat.context_ids() == expected + [first.record.token_id]


def test_a_plain_session_resumes_as_a_chat(tiny_model, tiny_policy):
    """A session from ``run`` (no budget, reply cut short) continues as a chat: the next turn
    adds the whole end-of-turn marker."""
    from positronic_brain.loop import Session

    session = Session(tiny_model, tiny_policy, SAMPLED)
    session.prime(tiny_policy.chat([("user", "hi")]), capacity=128)
    reply = tuple(r.token_id for r in session.stream(3))
    chat = Chat.resume(session, max_new_tokens=2)
    chat.say("again")
    assert chat.context_ids()[:-2] == _ids(tiny_policy, [("user", "hi"), ("assistant", reply)]) \
        + _ids(tiny_policy, [("user", "again")]) + tiny_policy.encode("<|im_start|>assistant\n")
    assert chat.stats()["budget"] is None


def test_bad_turns_are_refused_and_the_session_stays_intact(tiny_model, tiny_policy):
    chat = Chat(tiny_model, tiny_policy, system=SYSTEM, sampler=SAMPLED,
                cache_params=CacheParams(budget=64, sinks=2, recent=4), max_new_tokens=4)
    chat.say("hi")
    state = chat.session.state
    before = (chat.context_ids(), state.arena.n, state.next_position, state.step)
    for text, message in [("", "the turn is empty"), ("  \n", "the turn is empty"),
                          ("x" * 60, "the turn adds 81 tokens; the budget of 64 leaves room "
                                     "for 44 (19 kept)")]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            chat.say(text)
        assert (chat.context_ids(), state.arena.n, state.next_position, state.step) == before
    chat.say("ok")  # and the chat goes on
    state.check_valid()
    with pytest.raises(UserError, match="below half the model's 512 positions"):
        Chat(tiny_model, tiny_policy, cache_params=CacheParams(budget=256))
    with pytest.raises(UserError, match="leaves no room"):
        Chat(tiny_model, tiny_policy, system="s" * 60, cache_params=CacheParams(budget=64))


def test_a_captured_chat_replays_bit_exact(tiny_model, tiny_policy, tmp_path, one_thread):
    """The turns (stage 0 on the live state) are in the event log between the steps."""
    from positronic_brain.capture import CaptureTape

    capture = CaptureTape(tmp_path, {"model": tiny_model.name, "dtype": "float32",
                                       "fingerprint": tiny_model.fingerprint}, run_id="chat")
    chat = Chat(tiny_model, tiny_policy, system=SYSTEM, sampler=SAMPLED, max_new_tokens=6,
                cache_params=CacheParams(budget=48, sinks=2, recent=4), tape=capture)
    for q in ("one", "two", "three"):
        chat.say(q)
    capture.close(chat.session.stop_reason)
    report = replay(capture.dir, model=tiny_model)
    assert report.ok, report.mismatches[:3]
    assert report.compared["s0_extend"] == 3 and report.steps == 18


def _cli(capsys, *argv):
    code = main(["chat", "--model", "tiny-random", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_script_mode_end_to_end(capsys, tmp_path, one_thread):
    script = tmp_path / "turns.txt"
    script.write_text("hello\n\nhi you\n/stats\n/save " + str(tmp_path / "s.pbs")
                      + "\n/load " + str(tmp_path / "s.pbs") + "\nbye\n/context\n")
    code, out, err = _cli(capsys, "--script", str(script), "--json", "--budget", "48",
                          "--sinks", "2", "--recent", "4", "--max-new-tokens", "6",
                          "--system", SYSTEM, "--seed", "3")
    assert code == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    turns = [x for x in lines if "turn" in x]
    assert [x["user"] for x in turns] == ["hello", "hi you", "bye"]
    for x in turns:
        assert len(x["reply_ids"]) <= 6 and x["cache_len"] <= x["budget"] == 48
        assert x["max_position"] < 512 and x["rss_mb"] > 0
    assert turns[1]["culled"] > 0
    stats = next(x["stats"] for x in lines if "stats" in x)
    assert stats["turns"] == 2 and stats["steps"] == 12
    assert next(x["context"] for x in lines if "context" in x).startswith("<|im_start|>system\n")
    assert "errors 0" in err  # the summary line on stderr
    code, out, err = _cli(capsys, "--script", str(script), "--budget", "48", "--sinks", "2",
                          "--recent", "4", "--max-new-tokens", "3", "--seed", "3")
    assert code == 0, err  # plain: the replies, the /stats table, the /context panel
    assert all(s in out for s in ("steps", "cache length", "saved: ", "loaded: ", "context: "))
    replies = [x["reply"] for x in turns]
    assert out.startswith(replies[0][:1])


def test_ctrl_c_stops_the_reply_not_the_program(capsys, tmp_path, monkeypatch, one_thread):
    """SIGINT in the middle of a step: that step finishes, the reply stops there (cancelled),
    the state is valid and the next turn goes on."""
    import os
    import signal

    from positronic_brain.loop import Session

    step = Session.step

    def interrupted(self, *a, **k):
        if self.state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the third step runs
        return step(self, *a, **k)

    monkeypatch.setattr(Session, "step", interrupted)
    (tmp_path / "turns.txt").write_text("first\nsecond\n")
    code, out, err = _cli(capsys, "--script", str(tmp_path / "turns.txt"), "--json",
                          "--budget", "48", "--sinks", "2", "--recent", "4",
                          "--max-new-tokens", "6")
    assert code == 0, err
    first, second = (json.loads(x) for x in out.splitlines())
    assert (first["stop_reason"], first["tokens"]) == ("cancelled", 3)
    assert second["stop_reason"] == "max_new_tokens" and second["tokens"] == 6


@pytest.mark.parametrize("argv, message", [
    (["--script", "SCRIPT", "--budget", "48", "--sinks", "2", "--recent", "4"],
     "line 2: unknown command '/nope'"),
    (["--script", "SCRIPT", "--budget", "48", "--sinks", "2", "--recent", "4"],
     "line 3: /save needs a PATH"),
    (["--json"], "--json needs --script"),
    (["--script", "/no/such/file"], "cannot read the script /no/such/file"),
    (["--allocation", "pairs"], "--allocation"),
    (["--allocation", "turns", "--repair", "merge", "--script", "SCRIPT"], "takes no merge repair"),
    (["--budget", "300", "--script", "SCRIPT"], "below half the model's 512 positions"),
])
def test_cli_bad_input_is_one_line(capsys, tmp_path, argv, message):
    script = tmp_path / "bad.txt"
    script.write_text("hi\n/nope\n/save\nagain\n")
    code, out, err = _cli(capsys, *[str(script) if a == "SCRIPT" else a for a in argv],
                          "--max-new-tokens", "2")
    assert code == 2, err
    errors = [x for x in err.splitlines() if x.startswith("positronic-brain: error: ")]
    assert any(message in x for x in errors), err
    assert "Traceback" not in err
