"""One retry of CPython's AST race around a Triton compile (CPython issue gh-106905).

On CPython 3.11.7 (and the releases near it) the conversion of a parsed tree to ``ast`` objects keeps its
recursion depth in state that every thread shares: two threads parsing source at once (Triton's
``JITFunction.parse`` when a kernel compiles, the interpreter's rewrite of a kernel's source, any
``ast.parse``) can leave it unbalanced, and the parse then raises ``SystemError: AST constructor recursion
depth mismatch``.  A parse has no side effect and the compile that raised it has launched nothing, so the
call is made once more.  Triton raises a race in the parse of a called ``@triton.jit`` helper as a
``CompilationError`` caused by it (``raise ... from``): that counts too.  Any other error, and a second race,
propagate.  Code of this package that
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
    """Whether ``err`` is gh-106905's SystemError, or an error raised from one (``__cause__``, as Triton wraps
    a callee's parse error); any other SystemError is not."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, SystemError) and AST_RACE_MESSAGE in str(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__
    return False


def retry_ast_race(call: Callable[[], T]) -> T:
    """``call()``, made a second time if the first raised gh-106905's SystemError (or an error from it)."""
    try:
        return call()
    except Exception as err:
        if not is_ast_race(err):
            raise
    return call()
