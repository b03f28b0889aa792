"""How ``xferkit bench`` fails: one line and an exit code per kind of failure."""

from __future__ import annotations

OK, CHECK, USAGE, DRIVER, FAILED, INTERRUPTED = 0, 1, 2, 3, 4, 130

EXIT_CODES = {
    OK: "every request completed (and every byte checked, unless --no-verify)",
    CHECK: "a byte check failed: a destination page differs from the model",
    USAGE: "a bad option, a model the options cannot shard, or a missing extra",
    DRIVER: "the driver is not installed or not usable here (or cannot cross processes)",
    FAILED: "a request or a rank failed: the Session's root cause is printed",
    INTERRUPTED: "interrupted (Ctrl-C): every rank process was stopped",
}


def exit_codes_help() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:<4}{text}" for code, text in EXIT_CODES.items())


class BenchError(Exception):
    """A failure the CLI prints as one line, exiting with ``code``."""

    def __init__(self, code: int, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail  # a rank's traceback, printed with --debug
