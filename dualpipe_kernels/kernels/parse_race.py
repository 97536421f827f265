"""One retry of CPython's AST race around a Triton compile (CPython issue gh-106905).

On CPython 3.11.7 (and the releases near it) the conversion of a parsed tree to ``ast`` objects keeps its
recursion depth in state that every thread shares: two threads parsing source at once (Triton's
``JITFunction.parse`` when a kernel compiles, the interpreter's rewrite of a kernel's source, any
``ast.parse``) can leave it unbalanced, and the parse then raises ``SystemError: AST constructor recursion
depth mismatch``.  A parse has no side effect and the compile that raised it has launched nothing, so the
call is made once more.  Any other SystemError, and a second race, propagate.  Code of this package that
compiles many kernels compiles them from one thread (:mod:`.offline`); this retry covers a compile that
races a thread outside it (an offload lane, a caller's thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["AST_RACE_MESSAGE", "is_ast_race", "retry_ast_race"]

#: the message of gh-106905's SystemError
AST_RACE_MESSAGE = "AST constructor recursion depth mismatch"

T = TypeVar("T")


def is_ast_race(err: BaseException) -> bool:
    """Whether ``err`` is gh-106905's SystemError (and not any other SystemError)."""
    return isinstance(err, SystemError) and AST_RACE_MESSAGE in str(err)


def retry_ast_race(call: Callable[[], T]) -> T:
    """``call()``, made a second time if the first raised gh-106905's SystemError."""
    try:
        return call()
    except SystemError as err:
        if not is_ast_race(err):
            raise
    return call()
