"""Runs vLLM's OpenAI-compatible server (arguments passed on) in a session of its own, and ends
it with everything it started when this process is told to (SIGTERM) or when the process that
started this one goes: a test killed on its timeout leaves no engine behind.
"""

import os
import signal
import subprocess
import sys
import time

GRACE_S = 20


def main() -> None:
    parent = os.getppid()
    child = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *sys.argv[1:]],
        start_new_session=True,
    )

    def end(*_: object) -> None:
        for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.1)
        sys.exit(child.returncode if child.returncode is not None else 1)

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    while child.poll() is None:
        if os.getppid() != parent:
            end()
        time.sleep(0.5)
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
