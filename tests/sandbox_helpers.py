"""Functions the sandbox tests run in the tool process (it imports them by name: no pytest, no torch)."""

import os
import time


def new_list() -> list:
    return []


def push(session: list, x) -> int:
    session.append(x)
    return len(session)


def contents(session: list) -> list:
    return list(session)


def sleep(session, seconds: float) -> str:
    time.sleep(seconds)
    return "awake"


def pow_int(session, base: int, exponent: int) -> int:
    return (base ** exponent).bit_length()  # one C-level loop: no signal can interrupt it


def allocate(session, n_bytes: int) -> int:
    return len(bytearray(n_bytes))


def fail(session) -> None:
    raise ValueError("the tool says no")


def die(session) -> None:
    os._exit(3)
