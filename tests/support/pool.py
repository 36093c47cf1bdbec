"""Worlds of rank processes shared by the whole pytest run (in the spirit of torch's ``MultiProcContinuousTest``).

A distributed test sends a module-level function to a world of N rank processes started once per run;
each rank runs ``fn(rank, world_size, *args)`` and its return value comes back to the test as an object.
Starting a world costs what importing torch and Lightning costs (seconds per process); a task costs a
process group.

[Note: one task's world]
Every task gets a default process group of its own (gloo, over a fresh prefix of one store the pytest
process keeps), destroyed when the task ends with every group made from it: collectives a task left
unmatched cannot pair with the next task's. Before each task a rank is put back the way a fresh process
spawned now would be: the pytest process's environment as it is now (a test's ``monkeypatch.setenv``
reaches the ranks, as it reached spawned ones) plus the rank's own variables, its working directory and
``sys.argv``, RNG
states (torch's default seed, as at start-up), thread count, default dtype, grad mode,
deterministic-algorithms flag, warning filters and signal handlers, Dynamo's caches and lightning_zero's
own ``functools`` caches (some hold what the environment said, e.g. whether host kernels are on). What cannot be
put back is checked: a task that leaves a function of lightning_zero or a method of ``torch.Tensor``
patched fails (naming it; the world is then started afresh). Its stdout and stderr (file descriptors 1
and 2, so C++ output too) go to a file per task and come back with the result, so pytest shows them with
the test that made them.

[Note: failures]
A rank that raises sends its traceback; one that dies (a crash, ``os._exit``) is seen through its pipe.
Either way the other ranks get a short grace to report (they often raise the same error), then the
task's deadline applies to the rest. Ranks still running then are hung: each dumps its Python stacks
(faulthandler on SIGUSR2), and the test fails with every rank's traceback or stacks. After any failure
the world is killed and started afresh for the next test, so no test inherits a broken one.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import itertools
import multiprocessing
import os
import pkgutil
import random
import signal
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

from tests.support.environment import child_env

STACK_SIGNAL = signal.SIGUSR2  # a hung rank dumps its stacks on it
GRACE_S = 5.0  # after a rank failed, how long the others get to report
RESTORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD)


class RankFailure(AssertionError):
    """A task failed on some rank: the message holds every rank's traceback (or, hung, its stacks).
    ``raised``, ``died`` (rank -> exit code) and ``hung`` say which ranks did what."""

    def __init__(self, report: str, raised: list[int], died: dict[int, int | None], hung: list[int]) -> None:
        super().__init__(report)
        self.raised, self.died, self.hung = raised, died, hung


# --- the rank processes --------------------------------------------------------------------------
def _serve(rank: int, world_size: int, store_port: int, conn: Connection, scratch: str) -> None:
    """A rank's life: run tasks until the pipe closes."""
    import torch
    import torch.distributed as dist

    importlib.import_module("lightning.pytorch")  # imported once, not inside the first task's time
    package = importlib.import_module("lightning_zero")
    for module in pkgutil.walk_packages(package.__path__, "lightning_zero."):  # all of it: see _FreshState.patched
        importlib.import_module(module.name)
    own = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    stacks = open(f"{scratch}.stacks", "w")  # open for the process's life
    faulthandler.enable(stacks)  # a crash writes its stack here
    faulthandler.register(STACK_SIGNAL, stacks, all_threads=True)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=60))
    fresh = _FreshState()
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        number, fn, args, timeout_s, environ = task
        with fresh.restored({**environ, **own}), _captured_output(f"{scratch}.out") as output:
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"task/{number}", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            try:
                outcome = ("ok", fn(rank, world_size, *args))
            except BaseException as error:  # a SystemExit or KeyboardInterrupt fails the task too
                outcome = ("error", "".join(traceback.format_exception(error)))
            finally:
                dist.destroy_process_group()
        patched = fresh.patched()
        if patched and outcome[0] == "ok":
            outcome = ("error", f"the task left {', '.join(patched)} patched on rank {rank} (undo what it patches)")
        try:
            conn.send((*outcome, output.text))
        except Exception as error:  # a result that does not pickle
            conn.send(("error", f"rank {rank}'s result could not be sent back: {error!r}", output.text))


class _FreshState:
    """What a task may change in a rank process, as it was at start-up (see [Note: one task's world])."""

    def __init__(self) -> None:
        import torch

        self.cwd = os.getcwd()
        self.argv = list(sys.argv)
        self.seed = torch.initial_seed()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.handlers = {s: signal.getsignal(s) for s in RESTORED_SIGNALS}
        self.functions = self._functions(torch)
        self.caches = [f for f in self.functions.values() if hasattr(f, "cache_clear")]

    @staticmethod
    def _functions(torch) -> dict[str, object]:
        """Every attribute of lightning_zero's modules and of ``torch.Tensor``, by qualified name."""
        found = {f"torch.Tensor.{k}": v for k, v in vars(torch.Tensor).items()}
        for name, module in list(sys.modules.items()):
            if name == "lightning_zero" or name.startswith("lightning_zero."):
                found.update({f"{name}.{k}": v for k, v in vars(module).items() if not k.startswith("__")})
        return found

    def patched(self) -> list[str]:
        """The functions among ``_functions`` that differ from start-up (put back, and named)."""
        import torch

        now = self._functions(torch)
        changed = sorted(k for k, v in self.functions.items() if now.get(k, v) is not v and callable(v))
        for name in changed:
            owner, _, attribute = name.rpartition(".")
            setattr(torch.Tensor if owner == "torch.Tensor" else sys.modules[owner], attribute, self.functions[name])
        return changed

    @contextmanager
    def restored(self, environ: dict[str, str]):
        import numpy as np
        import torch

        self._restore(torch, np, environ)
        try:
            with warnings.catch_warnings():
                yield
        finally:
            if "torch._dynamo" in sys.modules:
                torch._dynamo.reset()
            self._restore(torch, np, environ)
            gc.collect()

    def _restore(self, torch, np, environ: dict[str, str]) -> None:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(self.cwd)
        sys.argv[:] = self.argv
        torch.manual_seed(self.seed)
        random.seed(0)
        np.random.seed(0)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_grad_enabled(True)
        for cached in self.caches:
            cached.cache_clear()
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class _Output:
    text = ""


@contextmanager
def _captured_output(path: str):
    """File descriptors 1 and 2 go to ``path`` inside the block (so a rank that dies leaves its last words
    there for the report); its text is ``.text`` after."""
    output = _Output()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w+b") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            yield output
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            file.seek(0)
            output.text = file.read().decode(errors="replace")


# --- the pytest side -----------------------------------------------------------------------------
class RankWorld:
    """``world_size`` rank processes, started on first use and again after a failure."""

    def __init__(self, world_size: int, store, scratch: Path) -> None:
        self.world_size = world_size
        self.store = store
        self.scratch = scratch
        self.processes: list = []
        self.conns: list[Connection] = []

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(rank, self.world_size, self.store.port, theirs, str(self._scratch(rank))),
                name=f"rank {rank} of {self.world_size}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)

    def run(self, number: int, fn, args: tuple, *, timeout_s: float, deadline_s: float) -> list:
        if not self.processes:
            self._start()
        task = (number, fn, args, timeout_s, child_env())
        for conn in self.conns:
            conn.send(task)
        outcomes: dict[int, tuple] = {}  # rank -> (kind: ok, error or died; result or traceback; output)
        died: dict[int, int | None] = {}
        deadline = time.monotonic() + deadline_s
        first_failure: float | None = None
        while len(outcomes) < self.world_size:
            until = deadline if first_failure is None else min(deadline, first_failure + GRACE_S)
            pending = {self.conns[r]: r for r in range(self.world_size) if r not in outcomes}
            ready = wait(list(pending), timeout=max(0.0, until - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = pending[conn]
                try:
                    outcomes[rank] = conn.recv()
                except (EOFError, OSError):
                    self.processes[rank].join(timeout=5)
                    code = self.processes[rank].exitcode
                    died[rank] = code
                    outcomes[rank] = ("died", f"rank {rank} died (exit code {code})\n{self._last_words(rank)}", "")
                if outcomes[rank][0] != "ok" and first_failure is None:
                    first_failure = time.monotonic()
        for rank, (_, _, text) in sorted(outcomes.items()):
            if text:
                print(f"----- rank {rank} of {self.world_size}: output -----\n{text}", end="")
        if len(outcomes) == self.world_size and all(kind == "ok" for kind, _, _ in outcomes.values()):
            return [outcomes[r][1] for r in range(self.world_size)]
        hung = [r for r in range(self.world_size) if r not in outcomes]
        report = self._report(fn, outcomes, hung, deadline_s)
        self.close(kill=True)
        raised = [r for r, (kind, _, _) in sorted(outcomes.items()) if kind == "error"]
        raise RankFailure(report, raised, died, hung)

    def _report(self, fn, outcomes: dict, hung: list[int], deadline_s: float) -> str:
        for rank in hung:
            os.kill(self.processes[rank].pid, STACK_SIGNAL)
        time.sleep(1.0 if hung else 0.0)
        lines = [f"{fn.__module__}.{fn.__qualname__} failed on {self.world_size} ranks"]
        for rank in range(self.world_size):
            if rank in outcomes:
                kind, detail, _ = outcomes[rank]
                if kind != "ok":
                    lines.append(f"----- rank {rank}: {'raised' if kind == 'error' else 'died'} -----\n{detail}")
            else:
                lines.append(f"----- rank {rank}: still running after {deadline_s:.0f} s -----")
                lines.append(self._last_words(rank))
        ok = [r for r, o in outcomes.items() if o[0] == "ok"]
        if ok:
            lines.append(f"(ranks {ok} finished)")
        return "\n".join(lines)

    def _scratch(self, rank: int) -> Path:
        """Where a rank keeps its stacks (``.stacks``) and the running task's output (``.out``)."""
        return self.scratch / f"world{self.world_size}-rank{rank}"

    def _stacks(self, rank: int) -> str:
        path = self._scratch(rank).with_suffix(".stacks")
        return path.read_text(errors="replace")[-20_000:] if path.exists() else "(no stacks)"

    def _last_words(self, rank: int) -> str:
        """A dead rank's output in its last task and the stacks it dumped (a crash writes them)."""
        out = self._scratch(rank).with_suffix(".out")
        text = out.read_text(errors="replace")[-5_000:] if out.exists() else ""
        return f"its output:\n{text}\n{self._stacks(rank)}"

    def close(self, *, kill: bool = False) -> None:
        for conn in self.conns:
            try:
                if not kill:
                    conn.send(None)
                conn.close()
            except OSError:
                pass
        for process in self.processes:
            if kill:
                process.kill()
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for rank in range(len(self.processes)):
            for suffix in (".stacks", ".out"):
                self._scratch(rank).with_suffix(suffix).unlink(missing_ok=True)
        self.processes, self.conns = [], []


class RankPools:
    """One world per world size, for the whole pytest run; ``run`` sends a task to one."""

    def __init__(self, scratch: Path, *, timeout_s: float, deadline_s: float) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.scratch = scratch
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.worlds: dict[int, RankWorld] = {}
        self._numbers = itertools.count()

    def run(self, fn, world_size: int, *args, timeout_s: float | None = None, deadline_s: float | None = None) -> list:
        """``fn(rank, world_size, *args)`` on every rank of the world of ``world_size``; their results in rank
        order. ``timeout_s`` bounds each collective (the task's process group), ``deadline_s`` the task."""
        world = self.worlds.setdefault(world_size, RankWorld(world_size, self.store, self.scratch))
        return world.run(
            next(self._numbers),
            fn,
            args,
            timeout_s=timeout_s or self.timeout_s,
            deadline_s=deadline_s or self.deadline_s,
        )

    def close(self) -> None:
        """At the end of the run: the ranks hold nothing worth a clean exit (seconds each), so they are killed."""
        for world in self.worlds.values():
            world.close(kill=True)
        self.worlds = {}
