"""Tool calls in a child process: each call bounded in wall-clock time, the process in memory.

A model can write any call, and some calls never return: BFCL's `round_number(5, -10**12)`
makes CPython compute 10**(10**12), one C loop that no signal interrupts, and a file-system
backend expands the position string "1-99999999999" into a list. So tools run in a child
process (`python -m toolcollapse.sandbox FD`, started on the first call, its address space
capped with RLIMIT_AS) and the parent waits at most `timeout_s` for each answer. Past it, the
child is killed and started again, the call's outcome is a timeout, and every open session
is rebuilt by replaying the calls it had finished -- the tools are deterministic -- so the
other episodes in the batch lose nothing and the timed-out call leaves no trace.

A **session** is one object living in the child (an episode's BFCL backend instances, the
tool world's functions), built there by a picklable factory; a call is a module-level
function applied to it, `fn(session, *args)`. Requests and answers are pickles over a
socket pair. With `isolated=False` the same API runs everything in this process, unbounded.

The child imports only what the factories and functions need (no torch): it starts in
about 0.1 s, and a call costs about 0.1 ms more than in-process.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable


@dataclass(frozen=True)
class Outcome:
    ok: bool
    value: Any = None  # what the function returned, when ok
    error: str = ""  # else: "timeout: no answer within 5 s", "ValueError: ...", DIED, LOST, ...
    timed_out: bool = False


@dataclass
class _Session:
    factory: Callable[[], Any]
    stateless: bool = False  # its calls change nothing: none is kept for replay
    calls: list[tuple[Callable[..., Any], tuple[Any, ...], float]] = field(default_factory=list)  # (fn, args, limit)
    lost: bool = False  # could not be rebuilt (cannot happen with deterministic tools): its calls fail


class _ChildLost(Exception):
    def __init__(self, reason: str, timed_out: bool):
        super().__init__(reason)
        self.reason, self.timed_out = reason, timed_out


DIED = "the tool process died (out of memory, or killed)"
LOST = "the tool session was lost when the tool process restarted"
SETUP_S = 60.0  # allowance for starting the child and building a session (our code, not the model's)


class Sandbox:
    """Sessions and calls in a child process (or in this one, `isolated=False`: no limits)."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 2048, isolated: bool = True,
                 preload: tuple[str, ...] = ()):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.isolated = isolated
        self.preload = preload  # modules the child imports before it is ready (not on a call's clock)
        self._sessions: dict[int, _Session] = {}
        self._local: dict[int, Any] = {}  # isolated=False: the session objects themselves
        self._next_id = 0
        self._closed: list[int] = []  # sessions to close before the next request (see `track`)
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.restarts = 0  # how often the child was killed (a timeout) or died

    # ------------------------------------------------------------------ sessions

    def open(self, factory: Callable[[], Any], stateless: bool = False) -> int:
        """A new session built by `factory()`; its id. `stateless`: calls on it change nothing,
        so none is kept (a restart only builds it again)."""
        sid, self._next_id = self._next_id, self._next_id + 1
        session = self._sessions[sid] = _Session(factory, stateless)
        if not self.isolated:
            self._local[sid] = factory()
            return sid
        self._flush_closed()
        outcome = self._request(("open", sid, factory), self.timeout_s + SETUP_S)  # our code, not the model's
        session.lost = not outcome.ok  # a factory that fails, or a child that does not answer
        return sid

    def track(self, owner: Any, sid: int) -> None:
        """Close session `sid` once `owner` (the episode state holding it) is garbage. The close is
        sent with the next request, never from inside the garbage collector."""
        weakref.finalize(owner, self._closed.append, sid)

    def call(self, sid: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
             record: bool = True) -> Outcome:
        """`fn(session, *args)` in the child, within `timeout_s` (default: the sandbox's). An exception,
        a timeout or a dead child is an `Outcome` with `ok=False`; nothing a tool does raises here.
        `record=False`: a call that only reads, never replayed."""
        self._flush_closed()
        session = self._sessions[sid]
        limit = timeout_s or self.timeout_s
        if not self.isolated:
            try:
                return Outcome(True, fn(self._local[sid], *args))
            except Exception as err:
                return Outcome(False, error=f"{type(err).__name__}: {err}")
        if session.lost and not session.stateless:
            return Outcome(False, error=LOST)
        outcome = self._request(("call", sid, fn, args), limit)
        if record and not session.stateless and not (outcome.timed_out or outcome.error in (DIED, LOST)):
            session.calls.append((fn, args, limit))  # a stopped call's effect died with the child: not replayed
        return outcome

    # ------------------------------------------------------------------ the child

    def _request(self, message: tuple, timeout_s: float) -> Outcome:
        try:
            ok, payload = self._exchange(message, timeout_s)
        except _ChildLost as lost:
            self.restarts += 1
            self.shutdown()  # the next request starts a new child and rebuilds the sessions
            return Outcome(False, error=lost.reason, timed_out=lost.timed_out)
        except _Unsendable as err:
            return Outcome(False, error=str(err))
        return Outcome(True, payload) if ok else Outcome(False, error=payload)

    def _exchange(self, message: tuple, timeout_s: float) -> tuple[bool, Any]:
        """The child's answer (starting it, with every session rebuilt, if there is none);
        _ChildLost when it does not answer in time or dies."""
        if self._conn is None:
            self._start()
        session = self._sessions.get(message[1])
        if message[0] == "call" and session is not None and session.lost:  # its rebuild failed just now
            return False, LOST
        return self._send(message, timeout_s)

    def _send(self, message: tuple, timeout_s: float) -> tuple[bool, Any]:
        assert self._conn is not None
        try:
            data = pickle.dumps(message)
        except (pickle.PicklingError, RecursionError, TypeError, AttributeError) as err:
            raise _Unsendable(f"the call cannot be sent to the tool process: {type(err).__name__}: {err}") from None
        try:
            self._conn.send_bytes(data)
        except OSError:
            raise _ChildLost(DIED, timed_out=False) from None
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> tuple[bool, Any]:
        assert self._conn is not None
        try:
            if not self._conn.poll(timeout_s):
                raise _ChildLost(f"timeout: no answer within {timeout_s:g} s", timed_out=True)
            return self._conn.recv()
        except (EOFError, OSError):
            raise _ChildLost(DIED, timed_out=False) from None

    def _start(self) -> None:
        """A new child, ready (its modules imported), with every open session rebuilt: opened again
        and its recorded calls replayed, each with twice the limit it finished within."""
        given_up: set[int] = set()
        while True:
            self._spawn()
            try:
                self._receive(SETUP_S)  # "ready"
            except _ChildLost:
                self.shutdown()
                raise RuntimeError("the tool process does not start (python -m toolcollapse.sandbox)") from None
            try:
                for sid, session in self._sessions.items():
                    if sid not in given_up and (not session.lost or session.stateless):
                        session.lost = not self._rebuild(sid, session)
                return
            except _ChildLost:  # a call that finished before does not now: that session is given up
                session.lost = True
                given_up.add(sid)
                self.restarts += 1
                self.shutdown()

    def _rebuild(self, sid: int, session: _Session) -> bool:
        ok, _ = self._send(("open", sid, session.factory), self.timeout_s + SETUP_S)
        for fn, args, limit in session.calls if ok else ():
            self._send(("call", sid, fn, args), 2 * limit + 1)
        return ok

    def _spawn(self) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, TOOLCOLLAPSE_SANDBOX_MEMORY_MB=str(self.memory_mb),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # this process's modules
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "toolcollapse.sandbox", str(child.fileno()), *self.preload],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        except OSError:
            parent.close()
            raise
        finally:
            child.close()
        self._conn = Connection(parent.detach())

    def _flush_closed(self) -> None:
        while self._closed:
            sid = self._closed.pop()
            self._local.pop(sid, None)
            if self._sessions.pop(sid, None) is not None and self.isolated and self._conn is not None:
                self._request(("close", sid), self.timeout_s)

    def shutdown(self) -> None:
        """Stop the child; the next request starts a new one with every session rebuilt."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: modules may be gone
            pass


class _Unsendable(Exception):
    """A request that cannot be pickled (e.g. nested past the recursion limit): an error, no restart."""


def _serve(conn: Connection, parent: int) -> None:
    """The child's loop: answer requests until the parent goes away (the socket's EOF, or, where another
    process keeps the socket open, the parent's pid gone, checked every second)."""
    sessions: dict[int, Any] = {}
    conn.send((True, "ready"))
    while True:
        try:
            while not conn.poll(1.0):
                if os.getppid() != parent:
                    return
            message = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as err:  # a function this process cannot import
            conn.send((False, f"the tool process cannot load the request: {type(err).__name__}: {err}"))
            continue
        op, sid = message[0], message[1]
        try:
            if op == "open":
                sessions[sid] = message[2]()
                answer: tuple[bool, Any] = (True, None)
            elif op == "close":
                sessions.pop(sid, None)
                answer = (True, None)
            else:
                fn, args = message[2], message[3]
                answer = (True, fn(sessions[sid], *args))
        except Exception as err:  # a tool's failure (MemoryError included) is an answer
            answer = (False, f"{type(err).__name__}: {str(err)[:500]}")
        try:
            conn.send(answer)
        except Exception as err:  # an unpicklable result
            conn.send((False, f"the tool's result cannot be sent back: {type(err).__name__}: {err}"))


def _die_with_parent() -> int:
    """Linux: the kernel sends this process SIGKILL when its parent dies, however it dies (the socket's EOF would
    end the loop too, but not while a call runs); then a check that the parent did not die before that."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes  # (Linux only, as prctl)

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)
    return parent


def main() -> None:
    import resource  # here: POSIX only, and only the sandbox's own process needs it

    parent = _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; EOF ends the child
    for module in sys.argv[2:]:  # before the memory cap and the first call's clock
        importlib.import_module(module)
    limit = int(os.environ.get("TOOLCOLLAPSE_SANDBOX_MEMORY_MB", "2048")) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _serve(Connection(int(sys.argv[1])), parent)


if __name__ == "__main__":
    main()
