"""The worker core's table of moves and its dispatch: ``_TRANSITIONS`` (beside the states,
at the top of _worker_core.pyx) is the one list of allowed moves, and the engine's
``_DISPATCH`` calls exactly the transition methods the table names, no more."""
from __future__ import annotations

import ast
import os

import distributed_core
from distributed_core import WORKER_TASK_STATES, WorkerCore

wc = distributed_core._worker_core
SOURCE = os.path.join(os.path.dirname(distributed_core.__file__), "_worker_core.pyx")
PREFIX = "_transition_"


def _table_pairs() -> set:
    return {(start, finish) for start, finishes in wc._TRANSITIONS.items()
            for finish in finishes}


def _source_tree() -> ast.Module:
    with open(SOURCE, encoding="utf-8") as f:
        return ast.parse(f.read(), SOURCE)


def _transition_methods() -> set:
    """The names of WorkerCore's transition methods, read from the source (a compiled
    class does not list its cfuncs, and the test must see every function)."""
    tree = _source_tree()
    cls = next(node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == "WorkerCore")
    return {node.name for node in cls.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith(PREFIX)}


def test_the_table_names_only_states_of_the_machine_and_no_move_from_forgotten():
    states = set(WORKER_TASK_STATES)
    for start, finish in _table_pairs():
        assert start in states and finish in states and start != finish, (start, finish)
    assert "forgotten" not in wc._TRANSITIONS


def test_every_move_of_the_table_has_its_method_and_the_dispatch_calls_it():
    for start, finish in _table_pairs():
        name = f"{PREFIX}{start}_{finish}"
        assert callable(getattr(WorkerCore, name, None)), name
        assert wc._DISPATCH[start][finish] is getattr(WorkerCore, name), name


def test_the_dispatch_holds_exactly_the_moves_of_the_table():
    dispatched = {(start, finish) for start, row in wc._DISPATCH.items() for finish in row}
    assert dispatched == _table_pairs()


def test_every_transition_method_is_a_move_of_the_table():
    moves = {f"{PREFIX}{start}_{finish}" for start, finish in _table_pairs()}
    methods = _transition_methods()
    assert methods, "no transition methods found in the source"
    assert methods == moves, {"not in the table": methods - moves,
                              "without a method": moves - methods}


def test_the_table_sits_beside_the_states_at_the_top_of_the_module():
    tree = _source_tree()
    lines = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    lines.setdefault(target.id, node.lineno)
        elif isinstance(node, ast.ClassDef):
            lines.setdefault(node.name, node.lineno)
    assert lines["WORKER_TASK_STATES"] < lines["_TRANSITIONS"] < lines["WorkerTask"]

