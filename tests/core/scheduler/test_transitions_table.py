"""The scheduler core's table of moves and its dispatch: ``MOVES`` (beside the states, at the
top of _core.pyx) is the one list of allowed moves, and ``SchedulerState._move`` (a chain of
C int compares when compiled, so it cannot be generated from the table at no cost) has
exactly one case per entry, calling ``_transition_<start>_<finish>``, and refuses every
other pair.

The dispatch is read from the source with ``ast`` and run on every (start, finish) pair, so
the check holds for the compiled core too, whose cfuncs Python cannot call."""
from __future__ import annotations

import ast
import os

import pytest

import distributed_core
from distributed_core import TASK_STATES, InvalidTransition, SchedulerState

core = distributed_core._core
SOURCE = os.path.join(os.path.dirname(distributed_core.__file__), "_core.pyx")
REFUSED = "refused"


def _source() -> str:
    with open(SOURCE, encoding="utf-8") as f:
        return f.read()


def _method_name(start: str, finish: str) -> str:
    return f"_transition_{start}_{finish}".replace("-", "_")


def _state_constants(tree: ast.Module) -> dict:
    """``_S_<NAME> = cython.declare(cython.int, i)`` -> {"_S_<NAME>": TASK_STATES[i]}."""
    found = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.startswith("_S_")):
            index = node.value.args[1]
            assert isinstance(index, ast.Constant), ast.unparse(node)
            found[node.targets[0].id] = TASK_STATES[index.value]
    assert sorted(found.values()) == sorted(TASK_STATES)
    return found


def _move_function(tree: ast.Module) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "SchedulerState":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "_move":
                    return item
    raise AssertionError("SchedulerState._move not found")


def _dispatch(statements: list, values: dict, constants: dict) -> str:
    """Run ``_move``'s if/elif chain (its statements before the transition hook) on the
    states in ``values`` ({"start": ..., "finish": ...}): the transition method it calls,
    or REFUSED if it raises. Anything but compares of start / finish with a state
    constant, one call or a raise fails the test: the reading must stay exact."""
    for statement in statements:
        if isinstance(statement, ast.If):
            test = statement.test
            assert (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
                    and test.left.id in values and len(test.ops) == 1
                    and isinstance(test.ops[0], ast.Eq)
                    and isinstance(test.comparators[0], ast.Name)
                    and test.comparators[0].id in constants), ast.unparse(test)
            taken = values[test.left.id] == constants[test.comparators[0].id]
            return _dispatch(statement.body if taken else statement.orelse, values, constants)
        if isinstance(statement, ast.Raise):
            return REFUSED
        call = statement.value if isinstance(statement, ast.Expr) else None
        assert (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
                and call.func.attr.startswith("_transition_")), ast.unparse(statement)
        return call.func.attr
    raise AssertionError("a branch of _move neither moves nor refuses")


def dispatch_table(source: str) -> dict:
    """{(start, finish): the method ``_move`` calls, or REFUSED} for every pair of states."""
    tree = ast.parse(source, SOURCE)
    constants = _state_constants(tree)
    body = _move_function(tree).body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    chain = [body[0]]  # the transition hook follows the chain
    return {(start, finish): _dispatch(chain, {"start": start, "finish": finish}, constants)
            for start in TASK_STATES for finish in TASK_STATES}


def table_problems(source: str, moves) -> list:
    """Where ``_move`` in ``source`` and the table ``moves`` disagree (empty: nowhere)."""
    problems = []
    for (start, finish), called in sorted(dispatch_table(source).items()):
        if (start, finish) in moves and called != _method_name(start, finish):
            problems.append(f"{start} -> {finish} is in MOVES but _move calls {called}")
        elif (start, finish) not in moves and called != REFUSED:
            problems.append(f"{start} -> {finish} is not in MOVES but _move calls {called}")
    return problems


def test_move_dispatches_exactly_the_table():
    assert table_problems(_source(), core.MOVES) == []


def test_the_transition_methods_are_the_table():
    tree = ast.parse(_source(), SOURCE)
    methods = {item.name for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == "SchedulerState"
               for item in node.body if isinstance(item, ast.FunctionDef)}
    of_pair = {_method_name(a, b): (a, b) for a in TASK_STATES for b in TASK_STATES}
    assert {of_pair[name] for name in methods if name in of_pair} == set(core.MOVES)


def test_the_table_sits_beside_the_states():
    tree = ast.parse(_source(), SOURCE)
    lines = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            lines.setdefault(node.targets[0].id, node.lineno)
    first_class = min(node.lineno for node in tree.body if isinstance(node, ast.ClassDef))
    assert (lines["TASK_STATES"] < lines["MOVES"] < lines["_MOVE_BITS"] < lines["_S_RELEASED"]
            < lines["_NAMES"] < first_class)
    assert lines["_NAMES"] - lines["TASK_STATES"] < 60


def test_the_check_catches_a_case_added_to_one_side_only():
    source = _source()
    extra_case = source.replace(
        "            if finish == _S_RELEASED:\n"
        "                self._transition_memory_released(ts)\n",
        "            if finish == _S_RELEASED:\n"
        "                self._transition_memory_released(ts)\n"
        "            elif finish == _S_FORGOTTEN:\n"
        "                self._transition_memory_forgotten(ts)\n")
    assert extra_case != source
    assert table_problems(extra_case, core.MOVES) == [
        "memory -> forgotten is not in MOVES but _move calls _transition_memory_forgotten"]
    assert table_problems(source, core.MOVES | {("memory", "forgotten")}) == [
        "memory -> forgotten is in MOVES but _move calls refused"]
    swapped = source.replace("self._transition_queued_released(ts)",
                             "self._transition_queued_processing(ts)")
    assert swapped != source
    assert table_problems(swapped, core.MOVES) == [
        "queued -> released is in MOVES but _move calls _transition_queued_processing"]


def test_moves_and_its_bit_table_agree():
    assert all(a in TASK_STATES and b in TASK_STATES and a != b for a, b in core.MOVES)
    if not distributed_core._core.COMPILED:  # a C variable once compiled
        assert core._MOVE_BITS == sum(
            1 << (8 * TASK_STATES.index(a) + TASK_STATES.index(b)) for a, b in core.MOVES)


@pytest.mark.skipif(distributed_core._core.COMPILED,
                    reason="a cfunc: Python cannot call _move of the compiled core")
def test_move_refuses_every_pair_not_in_the_table_and_changes_nothing():
    state = SchedulerState(validate=True)
    state.update_graph("c", [{"key": "x", "spec": b"run"}], ["x"], "s1")
    ts = state.tasks["x"]
    before = (ts.state, state.transition_counter, state.task_counts())
    for i, start in enumerate(TASK_STATES):
        for j, finish in enumerate(TASK_STATES):
            if (start, finish) in core.MOVES:
                continue
            with pytest.raises(InvalidTransition, match=f"no transition {start} -> {finish}"):
                state._move(ts, i, j)
            assert (ts.state, state.transition_counter, state.task_counts()) == before
