"""``pdpfast train --nproc N``: the same command in N processes on this machine, one per rank.

The command starts its ranks itself (torchrun is not in between), so that a data-parallel run
behaves as one process does:

* **Stopping.** The ranks run in process groups of their own, so a Ctrl-C at the terminal reaches
  the command alone, and it hands each signal (SIGINT, SIGTERM) to every rank once. The ranks then
  agree on the step to stop after (``pdpfast.train``), rank 0 writes the final checkpoint, and the
  command exits with 128 + the signal's number. A second signal stops them at once, as it does one
  process; one that arrives within ``SAME_STOP_S`` of the first is the same request (``note_stop``,
  ``accept_stops``). Were the command itself killed, its ranks get SIGTERM (``follow_launcher``).
* **Failing.** When a rank fails, the others get a few seconds to fail alike (bad data stops every
  rank), then SIGTERM, then SIGKILL; the command exits with the failed rank's status.
* **One voice.** Rank 0 alone prints the run's report and warnings. The line that ends a rank (an
  error, an interruption) goes to the command (``report_ending``), which prints rank 0's and any
  other rank's that differs from it: every rank reads the same inputs, so an error in them is one
  line, not one per rank.

The ranks meet at ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set as torchrun sets them. Without
``OMP_NUM_THREADS`` or ``--threads``, each takes an equal share of the machine's cores. Without
``TORCH_CPP_LOG_LEVEL``, torch's C++ logs below errors are not shown.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# set in the environment of the processes ``run_ranks`` starts: the command then runs as that rank,
# started by the process LAUNCHER, and leaves the line that ends it in the folder ENDINGS
LAUNCHED, LAUNCHER, ENDINGS = "PDPFAST_LAUNCHED_RANK", "PDPFAST_LAUNCHER_PID", "PDPFAST_RANK_ENDINGS"
# after one rank fails, how long the others may take to end on their own before SIGTERM (and as long
# again before SIGKILL)
GRACE_S = 5.0


# A stop signal (SIGINT, SIGTERM) within SAME_STOP_S of the last one this process took as a stop
# request is that request again: the copy the command hands on to a rank that a scheduler also
# signalled, a second Ctrl-C while the first is being handled (``note_stop``, ``same_stop``).
SAME_STOP_S = 1.0
_LAST_STOP = [-math.inf]
# In a rank (``accept_stops``): when the last signal arrived. Python runs a handler only when the main
# thread next runs Python code; a rank waiting in a collective (the final checkpoint's barrier while
# rank 0 writes it) ran the command's copy of a signal seconds after it arrived, and took it for a
# second request (CI, stop 50). There a signal is timed by its arrival; elsewhere by its handler.
_ARRIVED: list[float | None] = [None]


def _signal_time() -> float:
    return time.monotonic() if _ARRIVED[0] is None else _ARRIVED[0]


def note_stop() -> None:
    """Record that this process took the signal being handled as a request to stop.

    Returns:
        None.
    """
    _LAST_STOP[0] = _signal_time()


def forget_stops() -> None:
    """Forget the last stop request (a new command starts in this process).

    Returns:
        None.
    """
    _LAST_STOP[0] = -math.inf


def same_stop() -> bool:
    """Whether a stop signal now is the last stop request again.

    Returns:
        True when the signal being handled came within ``SAME_STOP_S`` of the last ``note_stop``'s.
    """
    return _signal_time() - _LAST_STOP[0] <= SAME_STOP_S


def launched_rank() -> int | None:
    """This process's rank when ``run_ranks`` started it, else None.

    Returns:
        an int ≥ 0, or None.
    """
    value = os.environ.get(LAUNCHED)
    return None if value is None else int(value)


def outer_launcher() -> str | None:
    """What in the environment says this process is already one rank of a job of several (a
    torchrun job, or a leftover of one), or None.

    Returns:
        e.g. "WORLD_SIZE=2", or None when neither WORLD_SIZE > 1 nor LOCAL_RANK is set.
    """
    if launched_rank() is not None:
        return None
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and (name != "WORLD_SIZE" or value.strip() not in ("", "0", "1")):
            return f"{name}={value}"
    return None


def report_ending(line: str) -> bool:
    """In a rank ``run_ranks`` started: leave ``line`` (the error or interruption that ends the rank)
    for the command to print. Elsewhere nothing.

    Args:
        line: the whole line, e.g. "pdpfast train: error: ...".
    Returns:
        True when the line was left for the command, or is rank 0's to print (the caller prints
        nothing), else False.
    """
    rank, folder = launched_rank(), os.environ.get(ENDINGS)
    if rank is None or folder is None:
        return False
    if str(os.getppid()) != os.environ.get(LAUNCHER):
        # the command was killed before its ranks ended: rank 0 prints its line, and clears the folder
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        return rank != 0
    try:
        with open(os.path.join(folder, f"rank-{rank}"), "w", encoding="utf-8") as f:
            f.write(line)
    except OSError:
        return False
    return True


def _print_endings(folder: str, nproc: int, received: bool = False) -> None:
    """Rank 0's ending line, then every other rank's that differs from it (prefixed with its rank).
    Where a rank was interrupted, the others' errors are left out: they come of its leaving (a
    collective whose peer closed the connection), and the interruption is the news. ``received``:
    the command itself was sent a stop signal (and handed it on); then an interrupted rank's line is
    the command's own, unprefixed, whichever rank ended on it first (rank 0 may instead have ended
    with the error rank 1's leaving caused)."""
    lines = {}
    for rank in range(nproc):
        line = _ending(folder, rank)
        if line.strip():            # (a rank killed while it wrote leaves the file empty)
            lines[rank] = line
    interrupted = {rank: line for rank, line in lines.items() if line.partition(": ")[2].startswith("interrupted")}
    lines = interrupted or lines
    if received and interrupted and 0 not in interrupted:
        lines = {0: interrupted[min(interrupted)]}
    if 0 in lines:
        print(lines[0], file=sys.stderr)
    for rank, line in lines.items():
        if rank and line != lines.get(0):
            command, _, rest = line.partition(": ")
            print(f"{command} (rank {rank}): {rest}", file=sys.stderr)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accept_stops() -> None:
    """In a rank ``run_ranks`` started (from its main thread, once the command's handlers are set):
    take SIGINT and SIGTERM, which it started with blocked. They stay blocked in every thread; a
    daemon thread waits for them (``sigwaitinfo``), notes when each arrived, and has the main thread
    handle it (``_thread.interrupt_main``), so that ``same_stop`` compares arrivals. One the command
    handed on meanwhile arrives now: ``_Interrupted`` from the command's handler, which its caller turns
    into one line. Without ``sigwaitinfo`` (macOS) they are unblocked instead, and timed by their
    handlers. Elsewhere nothing.

    Returns:
        None.
    """
    if launched_rank() is None or threading.current_thread() is not threading.main_thread():
        return
    if not hasattr(signal, "sigwaitinfo"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
        return
    threading.Thread(target=_take_signals, name="pdpfast-signals", daemon=True).start()


def _take_signals() -> None:
    import _thread

    while True:
        signum = signal.sigwaitinfo((signal.SIGINT, signal.SIGTERM)).si_signo
        _ARRIVED[0] = time.monotonic()
        handler = signal.getsignal(signum)
        if handler is signal.SIG_DFL:       # no handler (the command has returned): what the signal does
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (signum,))
            signal.raise_signal(signum)
        elif handler is not signal.SIG_IGN:
            _thread.interrupt_main(signum)


def follow_launcher() -> None:
    """In a rank ``run_ranks`` started: have SIGTERM sent to it when the command that started it dies,
    so a killed command leaves no rank training on its own. On Linux the kernel sends it
    (``PR_SET_PDEATHSIG``); elsewhere a daemon thread looks for a new parent every ``WATCH_S`` seconds
    and sends it.

    Returns:
        None.
    Raises:
        RuntimeError when that command has already ended.
    """
    by_kernel = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            by_kernel = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) == 0   # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    launcher = os.environ.get(LAUNCHER)
    if launcher is None:
        return
    if os.getppid() != int(launcher):     # (after the request: a command that dies later is seen)
        raise RuntimeError("the `pdpfast train --nproc` command that started this rank has ended")
    if not by_kernel:
        threading.Thread(target=_watch_parent, args=(int(launcher),), name="pdpfast-follow-launcher",
                         daemon=True).start()


WATCH_S = 0.5   # how often a rank without PR_SET_PDEATHSIG looks for its command


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(WATCH_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _status(code: int) -> int:
    """A child's exit status as a shell reports it: 128 + n for a child killed by signal n."""
    return 128 - code if code < 0 else code


def run_ranks(argv: list[str], nproc: int, threads: int | None = None) -> int:
    """Run ``python -m pdpfast <argv>`` as ranks 0..nproc-1 of one data-parallel job and wait for them.

    Args:
        argv: the command's arguments (``--nproc`` included: each rank checks its settings with it).
        nproc: the number of processes, ≥ 2.
        threads: the command's ``--threads``, or None (then each rank gets ``OMP_NUM_THREADS`` = its
            share of the CPUs this process may run on, unless the environment sets it).
    Returns:
        the exit status: 0 when every rank succeeded; 128 + n when the command was sent signal n and
        the ranks stopped on it (after the same step, or outside the training steps); else the status
        of the rank that failed first (128 + n for one killed by signal n, with a line that says so).
    """
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), **{LAUNCHER: str(os.getpid())})
    # c10d logs, e.g., a rendezvous that a Ctrl-C interrupted as a warning with a 40-frame C++ stack;
    # its errors still come as Python exceptions
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if threads is None and "OMP_NUM_THREADS" not in env:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cpus // nproc))
    ranks: list[subprocess.Popen] = []
    received: list[int] = []
    endings = tempfile.TemporaryDirectory(prefix="pdpfast-ranks-")
    env[ENDINGS] = endings.name

    sent: list[int] = []                      # how many of the received signals each rank was sent

    def deliver():
        # each rank gets every signal once, whether it came before the rank started or after
        for rank, process in enumerate(ranks):
            while sent[rank] < len(received):
                signum = received[sent[rank]]
                sent[rank] += 1
                if process.poll() is None:
                    process.send_signal(signum)

    def hand_on(signum, frame):
        received.append(signum)
        deliver()

    stops = (signal.SIGINT, signal.SIGTERM)
    # handlers can be set from the main thread only; elsewhere (an API caller's thread) the ranks hear
    # of a stop only from a signal of their own
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, hand_on) for s in stops} if main else {}
    try:
        for rank in range(nproc):
            # Blocked while the rank starts, in this thread (so that a signal now waits for deliver() to
            # return rather than run hand_on inside it) and so in the rank, whose signal mask is this
            # thread's: the rank takes them once Python turns them into a clean stop (accept_stops).
            # One landing in its interpreter's startup was a fatal error with a traceback.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
            try:
                process = subprocess.Popen([sys.executable, "-m", "pdpfast", *argv], start_new_session=True,
                                           env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                                LAUNCHED: str(rank)})
                sent.append(0)          # (before the rank joins the list the handler walks)
                ranks.append(process)
                deliver()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        status = _wait(ranks, received, endings.name)
        _print_endings(endings.name, nproc, received=bool(received))
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for process in ranks:                 # only after an exception of this process's own
            if process.poll() is None:
                process.kill()
                process.wait()
        endings.cleanup()


def _ending(folder: str | None, rank: int) -> str:
    """The line the rank left in ``folder`` (``report_ending``), or "" where it left none."""
    if folder is None:
        return ""
    try:
        with open(os.path.join(folder, f"rank-{rank}"), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _stopped_after_a_step(folder: str | None, rank: int) -> bool:
    """Whether the rank's ending line says it stopped after a training step (``TrainingInterrupted``):
    then every rank agreed on that step, and the others are ending it too (rank 0 writing the final
    checkpoint, which may take a while)."""
    return " after step " in _ending(folder, rank)


def _wait(ranks: list[subprocess.Popen], received: list[int], folder: str | None = None) -> int:
    """Wait for every rank. Once one has failed (ended other than with success or after a training
    step on a stop the command asked for: 128 + n), the others get ``GRACE_S`` to end on their own,
    then SIGTERM, then SIGKILL: one stuck where a signal cannot reach it (waiting in the process
    group's rendezvous for a rank that stopped before it) would otherwise wait out its timeout. A
    rank that stopped on the asked signal outside the training steps counts as failed for this,
    though its status is the asked one. ``folder``: the ranks' ending lines (``report_ending``).
    Returns the status (``run_ranks``)."""
    failed: list[int] = []                    # ranks in the order they failed
    failed_at, ended = None, set()            # (signals sent to end the others: SIGTERM once, then SIGKILL)
    while True:
        asked = {128 + signum for signum in received}   # (a signal may come while the ranks run)
        codes = [process.poll() for process in ranks]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in failed and \
                    (code not in asked or not _stopped_after_a_step(folder, rank)):
                failed.append(rank)
        if all(code is not None for code in codes):
            break
        if failed:
            failed_at = failed_at or time.monotonic()
            waited = time.monotonic() - failed_at
            for rank, process in enumerate(ranks):
                if process.poll() is None and waited > GRACE_S:
                    how = signal.SIGKILL if waited > 2 * GRACE_S else signal.SIGTERM
                    if (rank, how) not in ended:
                        process.send_signal(how)
                        ended.add((rank, how))
        time.sleep(0.05)
    if not failed:
        return 128 + received[0] if any(process.returncode for process in ranks) else 0
    # the cause: a rank killed by a signal nothing here sent (a peer's leaving makes a rank end with an
    # error, never with a signal), else the first to fail; the others failed after it (a collective with
    # it broke), though a starved command may see both in one poll and rank 0 first
    sent = {rank for rank, _ in ended}
    killed = [rank for rank in failed if ranks[rank].returncode < 0 and -ranks[rank].returncode not in received
              and rank not in sent]
    first = killed[0] if killed else failed[0]
    code = ranks[first].returncode
    if code < 0 and -code in received:      # the signal the command handed on, outside the training steps
        print(f"pdpfast train: stopped by {signal.Signals(-code).name} outside the training steps (starting, or "
              "ending); the last checkpoint, if any, stands", file=sys.stderr)
        return 128 + received[0]
    if code < 0:                # a signal nothing here sent: no line of its own says why it ended
        print(f"pdpfast train: rank {first} was killed by {signal.Signals(-code).name} (out of memory, or a kill from "
              "outside); the others stopped with it", file=sys.stderr)
    return _status(code)
