"""The special-token policy: the only module that calls the tokenizer.

Nothing is ever added implicitly: text is encoded with ``add_special_tokens=False``;
BOS and chat-turn markers are added here, explicitly, per model family; chat turns
are formatted here (never by a chat template, which may inject a default system
prompt). What this module returns is exactly what gets primed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .types import SOURCES, Segment, UserError, require

# Tokenizers whose models expect a BOS token in front of raw text.
BOS_ADDING = ("<s>", "<|begin_of_text|>")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatFormat:
    name: str
    turn_open: str  # format() with role
    turn_close: str
    end_of_turn: str  # the special token that ends a turn (a stop token)


CHAT_FORMATS = (
    ChatFormat("chatml", "<|im_start|>{role}\n", "<|im_end|>\n", "<|im_end|>"),
    ChatFormat("llama3", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>",
               "<|eot_id|>"),
)


class TokenPolicy:
    """Encodes prompts and chat turns, decodes tokens; owns the tokenizer."""

    def __init__(self, tokenizer, bos: str = "auto"):
        require(bos in ("auto", "yes", "no"), f"bos must be auto, yes or no, got {bos!r}")
        self._tok = tokenizer
        vocab = tokenizer.get_vocab()
        self.bos_id = tokenizer.bos_token_id
        if bos == "auto":
            self.add_bos = tokenizer.bos_token in BOS_ADDING
        else:
            require(bos == "no" or self.bos_id is not None, "this tokenizer has no BOS token")
            self.add_bos = bos == "yes"
        self.chat_format = next((f for f in CHAT_FORMATS if f.end_of_turn in vocab), None)
        eos = {tokenizer.eos_token_id}
        if self.chat_format is not None:
            eos.add(vocab[self.chat_format.end_of_turn])
        self.eos_ids = frozenset(i for i in eos if i is not None)
        self.vocab_size = len(tokenizer)

    # --- encoding -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids; special-token strings in text are encoded as special tokens
        only when the chat format puts them there (never added implicitly). Text that is
        not Unicode (bytes not UTF-8 in a command-line argument) is a UserError."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"the text is not valid UTF-8 (at character {e.start}): "
                            f"{text[:40]!r}") from None
        return list(self._tok(text, add_special_tokens=False).input_ids)

    def raw_prompt(self, text: str, source: str = "user") -> list[Segment]:
        """A raw-text prompt (``run`` without chat formatting): [BOS if the family wants it] + text."""
        require(text != "", "the prompt is empty")
        ids = ([self.bos_id] if self.add_bos else []) + self.encode(text)
        return [Segment(tuple(ids), source)]

    def chat(self, turns: list[tuple[str, str | tuple[int, ...]]],
             add_generation_prompt: bool = True, bos: bool | None = None) -> list[Segment]:
        """Chat turns [(role, content)] -> segments, one per turn, each tagged with its role.

        ``content`` is text, or token ids taken as they are (a model's own reply is never
        re-tokenized). A system prompt appears only if it is one of ``turns``. With
        ``add_generation_prompt`` the assistant turn is opened for the model to continue.
        """
        fmt = self.chat_format
        if fmt is None:
            raise UserError("no chat format known for this tokenizer (ChatML or Llama-3 markers)")
        segs: list[Segment] = []
        if self.add_bos if bos is None else bos:
            segs.append(Segment((self.bos_id,), turns[0][0] if turns else "system"))
        for role, content in turns:
            require(role in ROLES, f"unknown chat role {role!r}; expected one of {ROLES}")
            body = self.encode(content) if isinstance(content, str) else list(content)
            ids = self.encode(fmt.turn_open.format(role=role)) + body + self.encode(fmt.turn_close)
            segs.append(Segment(tuple(ids), role))
        if add_generation_prompt:
            segs.append(Segment(tuple(self.encode(fmt.turn_open.format(role="assistant"))),
                                "assistant"))
        return segs

    def adds_bos_by_default(self) -> bool:
        """Whether the tokenizer's own encoding (its post-processor, special tokens on)
        starts with the BOS token: what a caller of ``tokenizer.encode`` gets."""
        return self.bos_id is not None and self._tok("a").input_ids[:1] == [self.bos_id]

    # --- decoding -----------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_ids


def require_same_tokens(a, b) -> None:
    """Two tokenizers must be one (a K/V transfer between their models carries token ids
    over): the same vocabulary, token -> id with the added tokens, and the same special
    tokens; else a one-line UserError naming the first difference."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        token = min(t for t in va.keys() | vb.keys() if va.get(t) != vb.get(t))
        raise UserError(f"the two models do not share a tokenizer: {len(va)} and {len(vb)} "
                        f"tokens, {token!r} is {va.get(token)} and {vb.get(token)}")
    sa, sb = a.special_tokens_map, b.special_tokens_map
    require(sa == sb, f"the two models do not share a tokenizer: special tokens {sa} and {sb}")


class TextStream:
    """Incremental detokenization: feed ids, get printable text deltas (no broken UTF-8).

    Decodes only a short window (the last emitted token(s) plus the new ones), so a
    long run costs O(1) per token; the window's first token gives merges and leading
    spaces their context.
    """

    def __init__(self, policy: TokenPolicy):
        self._policy = policy
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        window = self._ids[self._prefix:]
        before = self._policy.decode(self._ids[self._prefix:self._read])
        text = self._policy.decode(window)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""  # nothing printable yet (e.g. an incomplete UTF-8 sequence)
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    @property
    def text(self) -> str:
        return self._policy.decode(self._ids)


assert set(ROLES) == set(SOURCES)
