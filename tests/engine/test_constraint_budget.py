"""A structured-output constraint is a client's program for a recursive compiler: its budget is checked
before anything compiles it, the compile runs in a worker process that may die or stall without the
server, one compile serves every request naming the same text, and what is kept is bounded in bytes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from engine.constraint_budget import (
    ConstraintBudget,
    ConstraintTooLarge,
    bracket_depth,
    check_constraint,
    grammar_depth,
    json_depth,
)
from engine.errors import InvalidRequestError
from engine.structured import Constraint, GrammarCompiler


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"'


def slow_choices(n: int = 13000, tag: str = "c") -> str:
    """A choice list llguidance takes a good fraction of a second to compile, on any machine."""
    return json.dumps([f"{tag}{i:05d}x{(i * 7919) % 100003}" for i in range(n)])


def big_enum(n: int, tag: str = "v") -> str:
    return json.dumps({"enum": [f"{tag}{i:05d}-{(i * 7919) % 100003:06d}-{(i * 104729) % 99991:05d}"
                                for i in range(n)]})


# ---- the checks made before compiling ---------------------------------------------------------------


def test_a_ref_chain_counts_each_hop():
    assert json_depth(ref_chain(10)) >= 10
    assert json_depth(ref_chain(3000)) > 3000


def test_a_recursive_schema_counts_its_cycle_once():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert json_depth(tree) < 12
    check_constraint("json", json.dumps(tree), ConstraintBudget())


def test_rule_chains_are_measured_in_lark_and_gbnf():
    assert grammar_depth(lark_chain(500)) > 500
    gbnf = "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(500)) + '\nr500 ::= "a"'
    assert grammar_depth(gbnf) > 500
    # a recursive grammar (an expression language) is shallow: a cycle counts once
    expr = 'start: expr\nexpr: term ("+" term)*\nterm: factor ("*" factor)*\nfactor: NUMBER | "(" expr ")"\n' \
           'NUMBER: /[0-9]+/'
    assert grammar_depth(expr) < 10
    # names inside literals are not references
    assert grammar_depth('start: "r0 r1 r2" | /r0|r1/\nr0: "x"\nr1: r0') <= 3


def test_bracket_nesting_counts_and_escapes_do_not():
    assert bracket_depth("(" * 300 + "a" + ")" * 300) == 300
    assert bracket_depth(r"\(\(\(a") == 0


@pytest.mark.parametrize("kind,value", [
    ("json", json.dumps(ref_chain(3000))),
    ("grammar", lark_chain(3000)),
    ("regex", "(" * 400 + "a" + ")" * 400),
    ("structural_tag", json.dumps({"structures": [{"begin": "<f>", "schema": ref_chain(1000), "end": "</f>"}],
                                   "triggers": ["<f>"]})),
])
def test_deep_constraints_are_refused_before_compiling(kind, value):
    with pytest.raises(ConstraintTooLarge, match="--max-constraint-depth"):
        check_constraint(kind, value, ConstraintBudget())


def test_source_bytes_are_capped():
    with pytest.raises(ConstraintTooLarge, match="--max-constraint-kb"):
        check_constraint("choice", json.dumps(["x" * 100] * 100), ConstraintBudget(max_source_bytes=1000))
    check_constraint("choice", json.dumps(["x" * 100] * 5), ConstraintBudget(max_source_bytes=1000))


def test_json_text_deeper_than_the_parser_allows_is_refused_not_a_recursion_error():
    with pytest.raises(ConstraintTooLarge, match="not valid JSON"):
        check_constraint("json", "[" * 100_000 + "]" * 100_000, ConstraintBudget(max_source_bytes=1 << 20))


# ---- the compiler ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture
def compiler_with(hf_tokenizer):
    made: list[GrammarCompiler] = []

    def make(**budget) -> GrammarCompiler:
        made.append(GrammarCompiler(hf_tokenizer, len(hf_tokenizer), [hf_tokenizer.eos_token_id],
                                    ConstraintBudget(**budget)))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_crash_of_the_compiler_costs_the_worker_not_the_server(compiler_with):
    # With the depth check off, a rule chain this long overflows even a compile thread's large stack.
    compiler = compiler_with(max_depth=10**9, max_source_bytes=1 << 30, compile_timeout_s=120)
    with pytest.raises(InvalidRequestError, match="'grammar' could not be compiled") as err:
        compiler.compile(Constraint("grammar", lark_chain(150_000), field="grammar"))
    assert err.value.parameter == "grammar"
    assert compiler.compile(Constraint("regex", "[a-z]+")).new_matcher() is not None  # a fresh worker serves


def test_a_compile_past_its_deadline_is_refused_and_the_next_one_served(compiler_with):
    compiler = compiler_with(compile_timeout_s=0.05)
    with pytest.raises(InvalidRequestError, match=r"took longer than 0\.05 s.*--constraint-compile-timeout"):
        compiler.compile(Constraint("choice", slow_choices(), field="guided_choice"))
    slow_ok = compiler_with(compile_timeout_s=30)
    assert slow_ok.compile(Constraint("regex", "[0-9]+")) is not None


def test_one_compile_serves_every_request_naming_the_same_text(compiler_with):
    compiler = compiler_with()
    constraint = Constraint("choice", slow_choices(tag="same"), field="guided_choice")
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(constraint))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.num_compiled == 1
    assert len({id(r) for r in results}) == 1


def test_a_compile_nobody_waits_for_is_stopped(compiler_with):
    compiler = compiler_with(compile_timeout_s=60)
    compiler.compile(Constraint("regex", "warm"))  # the worker is up
    slow = Constraint("choice", slow_choices(tag="gone"), field="guided_choice")

    async def leave_early() -> None:
        task = asyncio.create_task(compiler.compile_async(slow))
        await asyncio.sleep(0.1)  # in the worker by now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave_early())
    deadline = time.monotonic() + 5
    while compiler._running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not compiler._running
    assert compiler.num_compiled == 1  # stopped, not finished and kept
    assert compiler.compile(Constraint("regex", "(yes|no)")) is not None  # the pool serves the next one
    assert compiler.num_compiled == 2


def test_one_compiled_grammar_over_its_memory_budget_is_refused(compiler_with):
    compiler = compiler_with(max_compiled_bytes=1 << 20)
    with pytest.raises(InvalidRequestError, match=r"MiB are kept for one constraint.*--max-constraint-compiled-mb"):
        compiler.compile(Constraint("json", big_enum(6000, "big"), field="guided_json"))


def test_kept_grammars_are_bounded_in_bytes(compiler_with):
    compiler = compiler_with(cache_bytes=2 << 20)
    for i in range(6):
        compiler.compile(Constraint("json", big_enum(1500, f"c{i}")))
        assert compiler.cached_bytes <= 2 << 20
    assert compiler.cached_bytes > 0


def test_a_refusal_is_remembered_as_a_refusal(compiler_with):
    compiler = compiler_with()
    bad = Constraint("grammar", "start: undefined_rule", field="ebnf")
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="'ebnf' cannot be used"):
            compiler.compile(bad)
    with pytest.raises(InvalidRequestError, match="'grammar' cannot be used"):  # named by each request's field
        compiler.compile(Constraint("grammar", "start: undefined_rule", field="grammar"))
    assert compiler.num_compiled == 0


def test_a_grammar_that_failed_while_matching_is_compiled_afresh(compiler_with):
    # the library's limits depend on the text generated: the failed copy is dropped, the text not refused
    compiler = compiler_with()
    constraint = Constraint("regex", "[a-f]+", field="guided_regex")
    first = compiler.compile(constraint)
    compiler.evict(constraint)
    assert compiler.cached_bytes == 0
    assert compiler.compile(constraint) is not first
    assert compiler.num_compiled == 2


def test_a_schema_embedded_in_a_grammar_is_measured_too():
    # tool_choice required / named compiles the calls as Lark with the parameters' schema under %json
    lark = f'start: call\ncall: "<tool_call>" args "</tool_call>"\nargs: %json {json.dumps(ref_chain(2000))}\n'
    with pytest.raises(ConstraintTooLarge, match="--max-constraint-depth"):
        check_constraint("grammar", lark, ConstraintBudget())
    with pytest.raises(ConstraintTooLarge, match="--max-constraint-depth"):
        check_constraint("grammar", "start: %json " + "[" * 5000 + "]" * 5000, ConstraintBudget())
    check_constraint("grammar", 'start: %json {"type": "object"}', ConstraintBudget())


def test_a_missed_deadline_is_not_remembered_as_a_refusal(compiler_with):
    # a busy machine may miss a deadline a quiet one meets: the next request tries again
    compiler = compiler_with(compile_timeout_s=0.05)
    constraint = Constraint("choice", slow_choices(tag="busy"), field="guided_choice")
    with pytest.raises(InvalidRequestError, match="took longer"):
        compiler.compile(constraint)
    compiler.budget = ConstraintBudget(compile_timeout_s=60)
    assert compiler.compile(constraint) is not None


def test_a_stop_that_lands_after_the_answer_never_reaches_the_next_compile(compiler_with):
    from engine.grammar_worker import GrammarWorker

    class LateStop(GrammarWorker):
        def _trial(self, *args):
            trial = super()._trial(*args)
            self.stop(self._job)  # its request left just as the answer was read
            return trial

    worker = LateStop(compiler_with()._setup)
    try:
        assert worker.trial("regex", "[a-z]+", None, 60, object()).grammar
        worker.__class__ = GrammarWorker
        assert worker.trial("regex", "[0-9]+", None, 60, object()).grammar  # a fresh worker, not the dying one
    finally:
        worker.close()


def test_percent_encoded_and_anchor_refs_are_followed_too():
    # the compiler percent-decodes a pointer and resolves $anchor names: so does the depth check
    defs = {f"d {i}": {"$ref": f"#/$defs/d%20{i + 1}"} for i in range(300)}
    defs["d 300"] = {"type": "string"}
    assert json_depth({"$defs": defs, "$ref": "#/$defs/d%200"}) > 300
    anchored = {f"a{i}": {"$anchor": f"n{i}", "$ref": f"#n{i + 1}"} for i in range(300)}
    anchored["a300"] = {"$anchor": "n300", "type": "string"}
    assert json_depth({"$defs": anchored, "$ref": "#n0"}) > 300


@pytest.mark.parametrize("grammar, reason", [('foo ::= "a"', "root"), ('root ::= "a" x', "x")],
                         ids=["no-root-rule", "undefined-rule"])
def test_a_gbnf_grammar_the_converter_refuses_says_why(compiler_with, grammar, reason):
    """llguidance's GBNF converter refuses a grammar with no root rule, or one naming an undefined rule, with a
    bare Exception: the field and the converter's reason reach the client, and the worker serves on."""
    compiler = compiler_with()
    with pytest.raises(InvalidRequestError, match="'guided_grammar' cannot be used") as err:
        compiler.compile(Constraint("grammar", grammar, field="guided_grammar"))
    assert err.value.parameter == "guided_grammar" and reason in str(err.value)
    assert compiler.compile(Constraint("grammar", 'root ::= "a"', field="guided_grammar")).new_matcher() is not None
