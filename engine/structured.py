"""Structured output: a request's ``Constraint`` (JSON schema, regex, grammar, choice list, structural
tag) compiled once by a grammar library (llguidance), cached by its text, and applied as a token
bitmask per row inside the batched sampler, so constrained and free rows share one step.

Compilation happens off the engine thread (``AsyncEngine.generate``); the engine thread only creates a
matcher per sequence (a copy of the compiled one), fills masks and advances matchers."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

ConstraintKind = Literal["json", "json_object", "regex", "grammar", "choice", "structural_tag"]
BACKENDS = ("llguidance",)  # the choice of --structured-output-backend (and vLLM's --guided-decoding-backend)
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. ``value``: the schema (JSON text), regex, grammar (Lark, or GBNF /
    EBNF with ``::=``), the choices (a JSON list of strings), or the structural tag (JSON text)."""

    kind: ConstraintKind
    value: str = ""
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens (None: compact)
    field: str = "constraint"  # the request field it came from, named in errors

    @staticmethod
    def choice(options: list[str], field: str = "guided_choice") -> "Constraint":
        return Constraint("choice", json.dumps(list(options)), field=field)


class CompiledGrammar:
    """A validated grammar and a matcher at its start; each sequence gets a copy."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def new_matcher(self) -> Any:
        return self._matcher.deep_copy()


class GrammarCompiler:
    """llguidance behind one method: ``compile(constraint)``, cached and thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance

        self._ll = llguidance
        self.tokenizer = grammar_tokenizer(tokenizer, eos_token_ids)
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of a constraint; InvalidRequestError naming its field and the library's reason."""
        key = _without_field(constraint)  # the same grammar from another field is the same compiled one
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._grammar(constraint)
        try:
            matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        except Exception as exc:  # the library raises plain exceptions for grammars it cannot build
            raise InvalidRequestError(f"'{constraint.field}' cannot be used: {_first_line(str(exc))}",
                                      parameter=constraint.field) from None
        if matcher.is_error():
            raise InvalidRequestError(f"'{constraint.field}' cannot be used: {_first_line(matcher.get_error())}",
                                      parameter=constraint.field)
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, c: Constraint) -> str:
        M = self._ll.LLMatcher
        if c.kind in ("regex", "grammar") and not c.value.strip():
            raise InvalidRequestError(f"'{c.field}' is empty", parameter=c.field)
        try:
            if c.kind in ("json", "json_object"):
                schema = json.loads(c.value) if c.kind == "json" else {"type": "object"}
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object")
                options: dict[str, Any] = {"whitespace_flexible": c.whitespace_pattern is not None}
                if c.whitespace_pattern:
                    options["whitespace_pattern"] = c.whitespace_pattern
                return M.grammar_from_json_schema(schema, defaults=options)
            if c.kind == "regex":
                return M.grammar_from_regex(c.value)
            if c.kind == "choice":
                options = json.loads(c.value)
                if not options or not all(isinstance(o, str) and o for o in options):
                    raise ValueError("choices must be a non-empty list of non-empty strings")
                return M.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
            if c.kind == "grammar":  # Lark as written, or GBNF / xgrammar-style EBNF (root ::= ...) converted
                from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

                try:
                    return M.grammar_from_lark(any_to_lark(c.value))
                except GbnfToLarkError as exc:
                    raise ValueError(str(exc)) from None
            if c.kind == "structural_tag":
                return self._structural_tag(json.loads(c.value))
        except InvalidRequestError:
            raise
        except (ValueError, TypeError, KeyError, AssertionError) as exc:
            raise InvalidRequestError(f"'{c.field}' cannot be used: {exc}", parameter=c.field) from None
        raise InvalidRequestError(f"'{c.field}': unknown constraint kind {c.kind!r}", parameter=c.field)

    def _structural_tag(self, spec: dict[str, Any]) -> str:
        """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]} -> text with
        tagged, schema-constrained segments wherever a trigger starts one."""
        tags = []
        for s in spec["structures"]:
            trigger = next((t for t in spec.get("triggers", []) if s["begin"].startswith(t)), s["begin"])
            tags.append(self._ll.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema") or {},
                                           end=s.get("end", "")))
        return self._ll.StructTag.to_grammar(tags, assume_special=False)


def grammar_tokenizer(hf_tokenizer: Any, eos_token_ids: list[int]) -> Any:
    """llguidance's view of the tokenizer: each token's bytes, and the tokens that end an answer.

    A byte-level BPE (GPT-2 style: a ByteLevel pre-tokenizer) is decoded byte-level. Some converted
    tokenizers (transformers' GGUF loader) put SentencePiece-style ByteFallback decoders in front of
    it, which would make llguidance read the byte tokens as literal characters ("Ġ", "Ċ") and let a raw
    newline into a JSON string; the decoder is set to plain ByteLevel for them."""
    import llguidance

    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if spec.get("model", {}).get("type") == "BPE" and any(p.get("type") == "ByteLevel" for p in pres):
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=len(hf_tokenizer), eos_token=list(eos_token_ids))


def _without_field(c: Constraint) -> Constraint:
    return Constraint(c.kind, c.value, c.whitespace_pattern)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "invalid"


class MaskApplier:
    """Fills the constrained sequences' bitmasks (llguidance's executor, in parallel) and applies them to
    logits. ``prepare`` starts the fill on a helper thread so it runs while the model's forward does
    (both release the GIL); ``apply`` waits for it and masks the sampled rows."""

    def __init__(self, compiler: GrammarCompiler, num_threads: int | None = None, kernels: Any = None) -> None:
        import llguidance
        import llguidance.torch

        self._lt = llguidance.torch
        self.compiler = compiler
        self.executor = llguidance.LLExecutor(num_threads)
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._bits = torch.arange(32, dtype=torch.int32)
        self.kernels = kernels  # the fused CPU kernels' apply_token_bitmask, when built

    def prepare(self, seqs: list[Any]) -> PreparedMasks:
        """Start filling the masks of ``seqs`` (each with a matcher) for the tokens they sample next."""
        mask = self._lt.allocate_token_bitmask(len(seqs), self.compiler.tokenizer.vocab_size)
        pairs = [(s.matcher, i) for i, s in enumerate(seqs)]
        future = self._helper.submit(self._lt.fill_next_token_bitmask_par, self.executor, pairs, mask)
        return PreparedMasks(self, {id(s): i for i, s in enumerate(seqs)}, mask, future)

    def apply(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
        """logits [B, V] in place: row rows[i] keeps only the tokens mask[i] allows."""
        if self.kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            self.kernels.apply_token_bitmask(logits, mask, torch.tensor(rows, dtype=torch.int64))
            return
        allowed = ((mask.unsqueeze(-1) >> self._bits) & 1).view(len(rows), -1).bool()  # [R, 32 * words]
        vocab = logits.shape[1]
        width = min(vocab, allowed.shape[1])
        index = torch.tensor(rows)
        sub = logits[index]
        sub[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
        if vocab > width:  # ids beyond the tokenizer's: never part of a grammar
            sub[:, width:] = float("-inf")
        logits[index] = sub


@dataclass
class PreparedMasks:
    """The masks of one step's constrained sequences, being filled; ``apply`` waits for them."""

    applier: MaskApplier
    row_of: dict[int, int]  # id(sequence) -> its row in ``mask``
    mask: torch.Tensor
    future: Future

    def apply(self, logits: torch.Tensor, seqs: list[Any]) -> list[int]:
        """Mask the logits rows of the constrained ``seqs``; returns those rows."""
        self.future.result()
        rows = [i for i, s in enumerate(seqs) if id(s) in self.row_of]
        if rows:
            picked = self.mask[torch.tensor([self.row_of[id(seqs[i])] for i in rows])].contiguous()
            self.applier.apply(logits, rows, picked)
        return rows
