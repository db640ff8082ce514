"""A process that has imported the training stack once and forks a fresh `train`/`bench` command
(or a test's script, named by its path) per request, so a test can start (and `kill -9`) many real processes without paying the ≈8 s of
torch + transformers imports each time.

The server never runs a tensor operation itself: forking before any OpenMP thread pool exists is
what makes the children safe (PyTorch's DataLoader workers rely on the same rule).

Protocol: one JSON request per line on stdin, one JSON answer per line on stdout.
    {"op": "run", "command": "train", "argv": [...], "stderr": "path", "stdout": "path" | null,
     "env": {...}} → {"pid": 123}
    {"op": "poll", "pid": 123} → {"code": null | int}
    {"op": "wait", "pid": 123} → {"code": int}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

COMMANDS = {"train": "benchtrain.train.cli", "bench": "benchtrain.bench.cli"}


def exit_code(status: int) -> int:
    # A child killed by a signal reads as -signal, like subprocess.Popen.returncode.
    return os.waitstatus_to_exitcode(status)


def run_child(command: str, argv: list[str], stderr_path: str, stdout_path: str | None, env: dict[str, str]) -> None:
    """In the forked child: run the command's entry point as `python -m <command>` would (a path
    ending in .py: the script, as `python <path>` would)."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stdout_path else devnull, 1)
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.environ.update(env)
        sys.argv = [command, *argv]
        if command.endswith(".py"):  # a script (tests/distributed_checks.py), run as `python script.py` runs it
            import runpy

            sys.path.insert(0, os.path.dirname(command))  # as python does: the script's folder first
            runpy.run_path(command, run_name="__main__")
            code = 0
        else:
            from benchtrain.common.errors import guard_cli

            module = __import__(COMMANDS[command], fromlist=["main"])
            code = guard_cli(module.main, argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    # Import what a run imports, without running anything.
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import benchtrain.bench.cli
    import benchtrain.train.cli
    import benchtrain.train.recipes.recipe  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "run":
            pid = os.fork()
            if pid == 0:
                run_child(
                    request["command"],
                    request["argv"],
                    request["stderr"],
                    request.get("stdout"),
                    request.get("env", {}),
                )
            answer: dict[str, Any] = {"pid": pid}
        elif request["op"] == "poll":
            done, status = os.waitpid(request["pid"], os.WNOHANG)
            answer = {"code": exit_code(status) if done else None}
        else:
            answer = {"code": exit_code(os.waitpid(request["pid"], 0)[1])}
        print(json.dumps(answer), flush=True)


class ForkServer:
    """Start with `with ForkServer(env) as server:`; children inherit `env`, plus what each request
    adds (tests share one server: tests/conftest.py's `fork_server`)."""

    def __init__(self, env: dict[str, str]) -> None:
        root = Path(__file__).resolve().parents[1]
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            env={**env, "PYTHONPATH": os.pathsep.join([str(root), env.get("PYTHONPATH", "")])},
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask(None) == {"ready": True}

    def ask(self, request: dict[str, Any] | None) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        if request is not None:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def start(
        self, command: str, argv: list[str], stderr: Path, stdout: Path | None = None, env: dict[str, str] | None = None
    ) -> int:
        request = {
            "op": "run",
            "command": command,
            "argv": argv,
            "stderr": str(stderr),
            "stdout": stdout and str(stdout),
            "env": env or {},
        }
        return int(self.ask(request)["pid"])

    def poll(self, pid: int) -> int | None:
        return self.ask({"op": "poll", "pid": pid})["code"]

    def wait(self, pid: int) -> int:
        return int(self.ask({"op": "wait", "pid": pid})["code"])

    def run_group(
        self,
        command: str,
        argv: list[str],
        folder: Path,
        env: dict[str, str] | None = None,
        processes: int = 2,
        timeout: float = 240,
    ) -> subprocess.CompletedProcess:
        """Run `command` as the ranks of one process group, with the variables torchrun sets for
        its workers; stdout and stderr are the ranks' outputs joined, in rank order. A rank still
        running after `timeout` seconds fails the test (and every rank is killed)."""
        import signal
        import socket
        import time

        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        folder.mkdir(parents=True, exist_ok=True)
        common = {
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes),
        }
        outputs = [(folder / f"rank{rank}.out", folder / f"rank{rank}.err") for rank in range(processes)]
        pids = [
            self.start(
                command, argv, err, out, {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
            )
            for rank, (out, err) in enumerate(outputs)
        ]
        codes: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while len(codes) < processes and time.monotonic() < deadline:
            codes.update({pid: code for pid in pids if pid not in codes and (code := self.poll(pid)) is not None})
            time.sleep(0.05)
        stdout = "".join(out.read_text() for out, _ in outputs)
        stderr = "".join(err.read_text() for _, err in outputs)
        if len(codes) < processes:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    self.wait(pid)
            raise AssertionError(
                f"{command} under {processes} processes did not finish within {timeout:.0f}s (a rank hung); stderr:\n{stderr[-3000:]}"
            )
        # Like torchrun: the group fails when any rank fails.
        code = next((codes[pid] for pid in pids if codes[pid] != 0), 0)
        return subprocess.CompletedProcess([command, *argv], code, stdout, stderr)

    def group_report(
        self,
        script: Path,
        arguments: list[str],
        processes: int = 2,
        timeout: float = 150,
        env: dict[str, str] | None = None,
    ) -> Any:
        """The JSON line rank 0 of `script` printed last, its ranks forked (the stack imported: ≈8 s
        less a rank than a new interpreter under torchrun) with the variables torchrun sets. For
        scripts whose ranks all end by themselves: a rank that fails does not end the others, as
        torchrun's agent would (tests that need that, tests/test_bench_probe_rows.py, use torchrun)."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
            variables = {"OMP_NUM_THREADS": "1", **(env or {})}
            result = self.run_group(
                str(script), arguments, Path(folder), env=variables, processes=processes, timeout=timeout
            )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    serve()
