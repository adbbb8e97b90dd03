"""Where the test suite's CPU goes: by kind of process and by the test that started it.

    python -m benchmarks.suite_cpu [--json FILE] [PYTEST ARGS ...]

A diagnostic, not part of the suite (Linux only). It runs ``python -m pytest`` with the given arguments
as its child and reads ``/proc`` every 0.4 s for pytest and its descendants (no other process): each
process the tests start inherits ``PYTEST_CURRENT_TEST``, which names the test that started it, so
every server, bootstrap peer, p2p daemon and command-line run is charged to a test file and to a kind
(``petals serve``, ``p2pd``, ``python -c`` ...). The total is exact: this process adopts orphaned daemons (a child subreaper), so
``getrusage`` counts every process of the run once it is reaped; what the samples attribute is a lower
bound (a process shorter than a sample, or its last 0.4 s, escapes them).

The floor it prints is the total CPU divided by the cores: no ordering or parallelism of the same work
can run the suite in less wall time on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
SAMPLE_SECONDS = 0.4
TEST_VARIABLE = b"PYTEST_CURRENT_TEST="
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Process:
    pid: int
    kind: str
    test_file: str  # "" for the pytest process itself
    command: str
    cpu: float = 0.0


def kind_of(command: str) -> str:
    """A short name for what a process runs, from its command line."""
    if "p2pd" in command.split(" ", 1)[0]:
        return "p2pd"
    if " -m pytest" in command:
        return "pytest (in-process servers and clients)"
    if match := re.search(r"petals\.cli\.run_(server|dht)\b", command):
        return {"server": "petals serve", "dht": "petals dht"}[match.group(1)]
    if match := re.search(r"(?:-m petals\.cli|petals/cli/__main__\.py|/bin/petals) (\w+)", command):
        return f"petals {match.group(1)}"
    if match := re.search(r" -m ([\w.]+)", command):
        return f"python -m {match.group(1)}"
    if re.search(r"python[\d.]* -c ", command):
        return "python -c (a fresh interpreter's imports)"
    return command.split(" ", 1)[0].rsplit("/", 1)[-1]


def read_process(pid: int) -> tuple[int, int, float, str, str | None] | None:
    """(parent, start time, CPU seconds, command line, test) of ``pid``, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None
    test = next(
        (item[len(TEST_VARIABLE) :].decode() for item in environ if item.startswith(TEST_VARIABLE)), None
    )
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return int(fields[1]), int(fields[19]), cpu, command.strip(), test


def sample(processes: dict[tuple[int, int], Process], pytest_pid: int) -> None:
    """Update ``processes`` with pytest and its descendants (orphans adopted by this process included):
    not another pytest's processes on the same machine, even under a test of the same name."""
    found = {int(pid): read_process(int(pid)) for pid in os.listdir("/proc") if pid.isdigit()}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, record in found.items():
        if record is not None:
            children[record[0]].append(pid)
    ours, pending = set(), [os.getpid(), pytest_pid, *(process.pid for process in processes.values())]
    while pending:
        for child in children.pop(pending.pop(), []):
            ours.add(child)
            pending.append(child)
    ours.add(pytest_pid)
    ours.discard(os.getpid())
    for pid in ours:
        if (record := found.get(pid)) is None:
            continue
        _, started, cpu, command, test = record
        if (pid, started) not in processes:
            test_file = "" if pid == pytest_pid else (test or "(no test)").split("::", 1)[0]
            processes[(pid, started)] = Process(pid, kind_of(command), test_file, command[:300])
        processes[(pid, started)].cpu = cpu


def reap_adopted(pytest_pid: int) -> None:
    """Reap each orphaned daemon this process adopts as soon as it exits (as init would: a test waiting
    for a daemon to be gone must not see a zombie), until pytest itself has exited."""
    while True:
        try:
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)  # who, without reaping it yet
        except ChildProcessError:
            return
        if exited is None or exited.si_pid == pytest_pid:
            return  # pytest's own exit is Popen's to collect; what is left is reaped at the end
        with contextlib.suppress(ChildProcessError):
            os.waitpid(exited.si_pid, 0)


def reap_orphans() -> bool:
    """Reap adopted daemons that have exited (their CPU then counts in this process's children); whether
    any is still running."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(rows: dict[str, list[float]], total: float, limit: int) -> list[str]:
    ordered = sorted(rows.items(), key=lambda item: -item[1][1])
    return [
        f"  {cpu:8.1f} s {cpu / total:6.1%}  {int(count):4d}  {name}"
        for name, (count, cpu) in ordered[:limit]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every process's record here")
    parser.add_argument("--top", type=int, default=25, help="test files to list (default 25)")
    args, pytest_args = parser.parse_known_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"Error: cannot adopt orphaned daemons (prctl: errno {ctypes.get_errno()}); Linux only")
    processes: dict[tuple[int, int], Process] = {}
    started = time.perf_counter()
    pytest = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args])
    threading.Thread(target=reap_adopted, args=(pytest.pid,), daemon=True).start()
    try:
        while pytest.poll() is None:
            sample(processes, pytest.pid)
            time.sleep(SAMPLE_SECONDS)
    except KeyboardInterrupt:
        pytest.send_signal(signal.SIGINT)
        pytest.wait()
    wall = time.perf_counter() - started
    deadline = time.monotonic() + 30  # daemons orphaned at the very end are still exiting
    while reap_orphans() and time.monotonic() < deadline:
        time.sleep(0.2)
    total = children_cpu()
    records = list(processes.values())
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_file: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for process in records:
        by_kind[process.kind][0] += 1
        by_kind[process.kind][1] += process.cpu
        if process.test_file:
            by_file[process.test_file][0] += 1
            by_file[process.test_file][1] += process.cpu
    attributed = sum(process.cpu for process in records)
    cores = os.cpu_count() or 1
    print(f"\n== suite CPU: pytest {' '.join(pytest_args)} (exit {pytest.returncode})")
    print(
        f"  wall {wall:.1f} s; CPU {total:.1f} s in all ({total / wall:.0%} of one core, {cores} cores here)"
    )
    print(f"  floor on {cores} cores: {total / cores:.1f} s (the CPU divided by the cores)")
    print(f"  sampled {attributed:.1f} s of it in {len(records)} processes")
    print("== by kind of process: CPU, share of all, processes")
    print("\n".join(table(by_kind, total, len(by_kind))))
    print("== by test file, the processes its tests started (pytest itself not included)")
    print("\n".join(table(by_file, total, args.top)))
    if args.json:
        summary = {"wall_seconds": wall, "cpu_seconds": total, "cores": cores}
        args.json.write_text(json.dumps({**summary, "processes": [asdict(process) for process in records]}))
    sys.exit(pytest.returncode)


if __name__ == "__main__":
    main()
