"""`pdpfast train --nproc N` (``pdpfast.launch``): a data-parallel run stops, fails and reports as one
process does. Before, torchrun stood between the command and its ranks: a stop request reached the
ranks at different steps and hung them for the process group's 10 minutes, a Ctrl-C left them running
with no parent, an input error came once per rank with torchrun's 25-line report, and the ranks never
saw --nproc (the one-process guard of --cuda-graph did not fire)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the ranks")


def _args(data_dir, checkpoint, *extra, budgets=None):
    return ["train", "--data", str(data_dir / "x.npy"), "--labels", str(data_dir / "y.npy"), "--budgets",
            str(budgets or data_dir / "budgets.npy"), "--hidden", "8", "--batch-size", "16", "--noise-seed", "1",
            "--quiet", "--checkpoint", str(checkpoint), *map(str, extra)]


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _processes_naming(text: str) -> list[int]:
    """The live processes whose command line holds ``text`` (a path unique to one test)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().split(") ")[-1][:1]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


def _ranks_of(launcher: subprocess.Popen) -> list[int]:
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    return sorted(int(pid) for pid in children)


def _start_training(data_dir, tmp_path, *extra, env=None):
    """A long 2-process run, once both ranks are past their first step (its first periodic checkpoint)."""
    checkpoint = tmp_path / "run.pt"
    launcher = subprocess.Popen([sys.executable, "-m", "pdpfast", *_args(data_dir, checkpoint, "--epochs", 500,
                                                                         "--checkpoint-every", 1, "--nproc", 2,
                                                                         *extra)],
                                env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not checkpoint.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.05)
    return launcher, checkpoint


def _finish(launcher: subprocess.Popen, checkpoint: Path, timeout: float = 90):
    try:
        out, err = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    time.sleep(0.5)
    assert _processes_naming(str(checkpoint)) == [], "a rank outlived the command"
    return launcher.returncode, out, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_nproc_command_stops_every_rank_after_one_step_with_a_final_checkpoint(data_dir, tmp_path,
                                                                                               signum):
    launcher, checkpoint = _start_training(data_dir, tmp_path)
    launcher.send_signal(signum)         # what a scheduler does (SIGTERM), or a Ctrl-C that reaches it alone
    rc, out, err = _finish(launcher, checkpoint)
    assert rc == 128 + signum, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdpfast train: interrupted"), err   # once, not once per rank
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["extra"]["interrupted"] is True and saved["extra"]["train_args"]["nproc"] == 2


def test_a_signal_to_one_rank_stops_both_after_the_same_step_instead_of_hanging(data_dir, tmp_path):
    """Before: the ranks stopped after different steps, waited in different collectives, and the job hung
    until the process group's 10-minute timeout, saving nothing (3 runs in 6 on 2 cores)."""
    launcher, checkpoint = _start_training(data_dir, tmp_path)
    os.kill(_ranks_of(launcher)[1], signal.SIGTERM)
    rc, out, err = _finish(launcher, checkpoint, timeout=60)
    assert rc == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err
    assert torch.load(checkpoint, weights_only=False)["extra"]["interrupted"] is True


def test_a_rank_killed_from_outside_ends_the_job_with_its_status_and_a_line_naming_it(data_dir, tmp_path):
    launcher, checkpoint = _start_training(data_dir, tmp_path)
    os.kill(_ranks_of(launcher)[1], signal.SIGKILL)
    rc, out, err = _finish(launcher, checkpoint, timeout=60)
    assert rc == 128 + signal.SIGKILL, err
    assert "rank 1 was killed by SIGKILL" in err


def test_the_ranks_of_a_killed_command_stop_after_their_step_and_save(data_dir, tmp_path):
    launcher, checkpoint = _start_training(data_dir, tmp_path)
    ranks = _ranks_of(launcher)
    launcher.kill()                      # no handler runs: the ranks learn of it from the kernel (SIGTERM)
    launcher.wait()
    deadline = time.monotonic() + 60
    while _processes_naming(str(checkpoint)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(checkpoint)) == [], f"ranks {ranks} kept training with no command"
    assert torch.load(checkpoint, weights_only=False)["extra"]["interrupted"] is True


@pytest.mark.parametrize("extra,budgets,message", [
    (("--epochs", 0), None, "--epochs must be a positive integer"),
    (("--method", "pdp"), None, "--method pdp does not run data parallel"),
    (("--cuda-graph", "--physical-batch-size", 4), None, "--cuda-graph is offered for"),
    pytest.param(("--device", "cuda"), None, "--device cuda", marks=pytest.mark.skipif(
        torch.cuda.device_count() >= 2, reason="two GPUs: the run is possible")),
    ((), "/nonexistent/budgets.npy", "/nonexistent/budgets.npy"),     # found by every rank when it reads the data
])
def test_a_bad_setting_or_input_of_an_nproc_run_is_one_line_not_one_per_rank(data_dir, tmp_path, extra, budgets,
                                                                              message):
    checkpoint = tmp_path / "run.pt"
    args = _args(data_dir, checkpoint, "--epochs", 1, "--nproc", 2, *extra, budgets=budgets)
    done = subprocess.run([sys.executable, "-m", "pdpfast", *args], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdpfast train: error: ") and message in lines[0], done.stderr
    assert "ChildFailedError" not in done.stderr and not checkpoint.exists()


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "LOCAL_RANK"])
def test_nproc_inside_a_job_of_several_processes_is_refused_not_run_as_one(cli, data_dir, tmp_path, monkeypatch,
                                                                           variable):
    """Before: with LOCAL_RANK set (under torchrun), --nproc 2 trained one process and said nothing."""
    monkeypatch.setenv(variable, "2" if variable == "WORLD_SIZE" else "0")
    message = cli.fails(*_args(data_dir, tmp_path / "run.pt", "--epochs", 1, "--nproc", 2))
    assert f"{variable}=" in message and "drop --nproc" in message


@pytest.mark.parametrize("option", [("--rounds", 3), ("--pdp-loss", "adaptive"), ("--pdp-charge", "sampled")])
def test_pdp_sgd_options_without_method_pdp_are_refused_not_ignored(cli, data_dir, tmp_path, option):
    message = cli.fails(*_args(data_dir, tmp_path / "run.pt", "--epochs", 1, *option))
    assert option[0] in message and "--method pdp" in message


def test_a_signal_to_every_process_of_the_job_at_once_is_one_stop_with_a_final_checkpoint(data_dir, tmp_path):
    """A scheduler (Slurm's time limit, pkill) signals every process: each rank heard it directly and
    again through the command, took the second as "stop at once", and the final checkpoint was lost
    (3 runs in 4)."""
    launcher, checkpoint = _start_training(data_dir, tmp_path)
    for pid in (launcher.pid, *_ranks_of(launcher)):
        os.kill(pid, signal.SIGTERM)
    rc, out, err = _finish(launcher, checkpoint)
    assert rc == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("pdpfast train: interrupted (SIGTERM)"), err
    assert torch.load(checkpoint, weights_only=False)["extra"]["interrupted"] is True


def test_a_rank_that_dies_while_the_command_stops_does_not_leave_the_other_waiting(data_dir, tmp_path):
    """Before: the others were ended only when no signal had come, so a Ctrl-C after a rank died left
    the survivor in the rendezvous, which no SIGINT interrupts, for 10 minutes."""
    checkpoint = tmp_path / "run.pt"
    launcher = subprocess.Popen([sys.executable, "-m", "pdpfast", *_args(data_dir, checkpoint, "--epochs", 500,
                                                                         "--nproc", 2)],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_ranks_of(launcher)) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.02)
    os.kill(_ranks_of(launcher)[1], signal.SIGKILL)
    time.sleep(1.0)
    launcher.send_signal(signal.SIGINT)
    start = time.monotonic()
    rc, out, err = _finish(launcher, checkpoint, timeout=60)
    assert time.monotonic() - start < 30 and rc != 0, err


def test_the_command_runs_its_ranks_from_a_thread_of_a_python_caller(data_dir, tmp_path, capsys):
    """Before: "signal only works in main thread" (the command set its handlers from any thread)."""
    import threading

    from pdpfast.cli import main

    result = []
    worker = threading.Thread(target=lambda: result.append(main(_args(data_dir, tmp_path / "run.pt", "--epochs", 1,
                                                                          "--nproc", 2))))
    worker.start()
    worker.join(timeout=240)
    assert result == [0], capsys.readouterr().err


def test_run_from_python_with_nproc_above_1_is_refused_not_trained_in_one_process(data_dir, tmp_path, monkeypatch):
    from pdpfast.train import TrainConfig, run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = TrainConfig(data=str(data_dir / "x.npy"), labels=str(data_dir / "y.npy"),
                      budgets=str(data_dir / "budgets.npy"), epochs=1, nproc=2, quiet=True)
    with pytest.raises(ValueError, match=r"nproc=2: run\(\) trains in this process"):
        run(cfg)


@pytest.mark.parametrize("delay", [0.0, 0.4, 1.2])
def test_a_ctrl_c_while_the_ranks_start_is_one_line_and_status_130_not_tracebacks(data_dir, tmp_path, delay):
    """Before: a SIGINT landing in a rank's interpreter startup was a fatal error, one in its imports a
    KeyboardInterrupt traceback per rank (or numpy's ImportError, which it becomes), and a rank that had
    caught it could still end by SIGINT ("stopped outside the training steps"). The ranks now start
    with the stop signals blocked and take them once Python can."""
    checkpoint = tmp_path / "run.pt"
    launcher = subprocess.Popen([sys.executable, "-m", "pdpfast", *_args(data_dir, checkpoint, "--epochs", 500,
                                                                         "--nproc", 2)],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_processes_naming(str(checkpoint))) < 3:       # the command and its two ranks
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.005)
    time.sleep(delay)
    launcher.send_signal(signal.SIGINT)
    rc, out, err = _finish(launcher, checkpoint, timeout=60)
    assert rc == 128 + signal.SIGINT, err
    assert err.strip().splitlines()[0].startswith("pdpfast train: interrupted"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_rank_without_the_kernels_parent_death_signal_still_stops_when_its_command_dies(tmp_path):
    """Linux's PR_SET_PDEATHSIG is what tells a rank that a killed command has gone; elsewhere (macOS)
    nothing did, and the ranks of a command killed outright trained on. A thread now watches for a
    new parent there; here sys.platform is set so that the rank takes that path."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    rank = (f"import os, signal, sys, time\nsys.platform = 'darwin'\nfrom pdpfast import launch\n"
            f"launch.WATCH_S = 0.05\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (open({str(stopped)!r}, 'w').close(), os._exit(0)))\n"
            f"launch.follow_launcher()\nopen({str(ready)!r}, 'w').close()\ntime.sleep(60)\n")
    command = (f"import os, subprocess, sys, time\n"
               f"env = dict(os.environ, PDPFAST_LAUNCHER_PID=str(os.getpid()), PDPFAST_LAUNCHED_RANK='0')\n"
               f"subprocess.Popen([sys.executable, '-c', {rank!r}], env=env)\ntime.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", command], env=_env())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        launcher.kill()
        deadline = time.monotonic() + 10
        while not stopped.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stopped.exists(), "the rank did not get SIGTERM after its command died"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in _processes_naming(str(ready)):
            os.kill(pid, signal.SIGKILL)


def test_ranks_that_stop_on_a_signal_the_command_got_while_waiting_are_not_failures(monkeypatch, tmp_path):
    """The statuses the command asked for (128 + a signal it handed on) were read once, before any
    signal came: ranks that stopped on it after a step counted as failed, and the others, rank 0
    writing its final checkpoint say, got SIGTERM after GRACE_S, then SIGKILL."""
    from pdpfast import launch

    monkeypatch.setattr(launch, "GRACE_S", 0.2)
    (tmp_path / "rank-1").write_text("pdpfast train: interrupted (SIGINT) after step 3 of 90; checkpoint 'c.pt' "
                                     "holds every step taken: continue with --resume c.pt")
    # (the signal comes 0.1 s in, the quick rank ends at 1 s: a margin for a loaded machine's late timer)
    quick = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(1.0); sys.exit(130)"])
    saving = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                               "signal.signal(signal.SIGTERM, lambda *a: sys.exit(99))\ntime.sleep(2.5)\n"
                               "sys.exit(130)"])
    received: list[int] = []
    import threading

    threading.Timer(0.1, lambda: received.append(signal.SIGINT)).start()     # as hand_on does
    assert launch._wait([saving, quick], received, str(tmp_path)) == 130
    assert saving.returncode == 130, "the rank still saving was ended as if another had failed"


def test_a_rank_killed_from_outside_is_the_cause_though_the_command_saw_the_error_it_caused_in_the_same_poll(
        tmp_path, capsys):
    """A command starved on a loaded machine may first poll after both have ended: rank 1 killed, and rank 0
    with the error its leaving caused. Rank 0, the first in rank order, was taken for the cause: its status,
    and no line saying that rank 1 was killed."""
    from pdpfast import launch

    erred = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    erred.wait(), killed.wait()
    assert launch._wait([erred, killed], [], str(tmp_path)) == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err


def test_a_rank_left_waiting_by_one_that_stopped_before_the_steps_is_ended(monkeypatch, tmp_path):
    """A Ctrl-C that stops one rank before the training steps (its imports) can leave another in the
    rendezvous, where no signal reaches it: the command ends it (SIGTERM, then SIGKILL) instead of
    waiting out the process group's 10 minutes."""
    from pdpfast import launch

    monkeypatch.setattr(launch, "GRACE_S", 0.2)
    (tmp_path / "rank-1").write_text("pdpfast train: interrupted")
    stopped = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(130)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                              "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"])
    start = time.monotonic()
    assert launch._wait([stuck, stopped], [signal.SIGINT], str(tmp_path)) == 130
    assert stuck.returncode == -signal.SIGKILL and time.monotonic() - start < 10


def test_a_ranks_interruption_is_the_line_not_the_error_it_caused_in_another(tmp_path, capsys):
    from pdpfast import launch

    (tmp_path / "rank-0").write_text("pdpfast train: error: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    (tmp_path / "rank-1").write_text("pdpfast train: interrupted")
    (tmp_path / "rank-2").write_text("")                                  # killed while it wrote
    launch._print_endings(str(tmp_path), 3)
    assert capsys.readouterr().err.splitlines() == ["pdpfast train (rank 1): interrupted"]


def test_a_ctrl_c_on_the_command_is_its_own_line_even_where_rank_0_ended_on_the_error_it_caused(tmp_path, capsys):
    """The command handed a Ctrl-C to both ranks; rank 1 stopped first, and rank 0's collective failed
    on its leaving before its own copy of the signal arrived. The interruption is the command's, so
    its line is unprefixed (as where rank 0 ended on it); this was a rare flake of the test above."""
    from pdpfast import launch

    (tmp_path / "rank-0").write_text("pdpfast train: error: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    (tmp_path / "rank-1").write_text("pdpfast train: interrupted")
    launch._print_endings(str(tmp_path), 2, received=True)
    assert capsys.readouterr().err.splitlines() == ["pdpfast train: interrupted"]


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGINT)])
def test_a_second_signal_just_after_the_first_is_the_same_stop_even_once_the_steps_have_ended(data_dir, tmp_path,
                                                                                             first, second):
    """A scheduler's SIGTERM and a Ctrl-C 50 ms later (or two Ctrl-Cs, or the copy the command hands a rank
    that was signalled too): the steps end on the first within a few ms, and the second used to land
    outside them: the line became "interrupted" with no resume hint (status 130 for a SIGTERM), or the
    interpreter's exit printed a KeyboardInterrupt, or it died of SIGINT."""
    checkpoint = tmp_path / "run.pt"
    process = subprocess.Popen([sys.executable, "-m", "pdpfast", *_args(data_dir, checkpoint, "--epochs", 500,
                                                                        "--checkpoint-every", 1)],
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not checkpoint.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    process.send_signal(first)
    time.sleep(0.05)
    process.send_signal(second)
    rc, out, err = _finish(process, checkpoint, timeout=60)
    assert rc == 128 + first, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "after step" in lines[0] and "--resume" in lines[0], err



def _slow_final_checkpoint(tmp_path, seconds: float) -> dict:
    """An environment in which rank 0 takes ``seconds`` more over the final checkpoint (a
    ``sitecustomize`` the ranks import), while rank 1 waits in its barrier, out of Python's reach."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('PDPFAST_LAUNCHED_RANK') == '0':\n"
        "    import time\n"
        "    from pdpfast import engine\n"
        "    save = engine.PrivacyEngine.save_checkpoint\n"
        "    def slow(self, path, module, **extra):\n"
        "        if extra.get('interrupted'):\n"
        f"            time.sleep({seconds})\n"
        "        return save(self, path, module, **extra)\n"
        "    engine.PrivacyEngine.save_checkpoint = slow\n")
    env = _env()
    return dict(env, PYTHONPATH=str(hook) + os.pathsep + env["PYTHONPATH"])


def test_the_commands_copy_of_a_signal_that_a_rank_handles_late_is_still_the_same_stop(data_dir, tmp_path):
    """CI (stop 50), a scheduler signalling every process: rank 1 took its own signal, then waited in the
    final checkpoint's barrier while rank 0 wrote it (slowly, on a loaded machine). The command's copy
    arrived during that wait, but Python ran its handler only after the barrier, more than a second
    after the first: a second request, so "interrupted", status 130. The copy is judged by when it
    arrived."""
    launcher, checkpoint = _start_training(data_dir, tmp_path, env=_slow_final_checkpoint(tmp_path, 3.0))
    os.kill(_ranks_of(launcher)[1], signal.SIGTERM)     # rank 1's own: the ranks stop after the next step
    time.sleep(0.25)                                    # rank 1 now waits for rank 0's final checkpoint
    # (the copy must reach the command within SAME_STOP_S = 1 s of rank 1's signal: a 0.75 s margin)
    launcher.send_signal(signal.SIGTERM)                # the command's copy reaches it within the wait
    rc, out, err = _finish(launcher, checkpoint)
    assert rc == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("pdpfast train: interrupted (SIGTERM) after step"), err
    assert torch.load(checkpoint, weights_only=False)["extra"]["interrupted"] is True


def test_a_second_ctrl_c_that_a_rank_handles_late_still_stops_it_at_once_after_the_write(data_dir, tmp_path):
    """The other side of the rule above: a second Ctrl-C that arrives more than a second after the
    first is a second request in every rank, though rank 1 runs its handler late; rank 0 finishes the
    checkpoint it is writing first."""
    launcher, checkpoint = _start_training(data_dir, tmp_path, env=_slow_final_checkpoint(tmp_path, 3.0))
    launcher.send_signal(signal.SIGINT)
    time.sleep(1.5)
    launcher.send_signal(signal.SIGINT)
    rc, out, err = _finish(launcher, checkpoint)
    assert rc == 128 + signal.SIGINT, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == "pdpfast train: interrupted", err        # at once: no "after step"
    assert torch.load(checkpoint, weights_only=False)["extra"]["interrupted"] is True


def test_a_ranks_signals_are_timed_on_arrival_and_handled_as_their_disposition_says():
    """``launch.accept_stops`` in a rank: a signal that the main thread can only handle later (here it
    sleeps; in a rank it waits in a collective) keeps the time it arrived; one set to SIG_IGN is
    dropped; one with no handler left does what it does by default (ends the process)."""
    script = (
        "import os, signal, sys, time\n"
        "os.environ['PDPFAST_LAUNCHED_RANK'] = '0'\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))   # as run_ranks starts one\n"
        "from pdpfast import launch\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: got.append((time.monotonic(), launch._ARRIVED[0])))\n"
        "launch.accept_stops()\n"
        "sent = time.monotonic()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(1.5)                      # no signal cuts it: they are blocked here\n"
        "deadline = time.monotonic() + 10\n"
        "while not got and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "handled, arrived = got[0]\n"
        "print(round(arrived - sent, 3), round(handled - sent, 3), flush=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.3)\n"
        "print('ignored', flush=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(10)\n"
        "print('still alive', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    timing, ignored = done.stdout.splitlines()
    arrived, handled = map(float, timing.split())
    assert arrived < 0.5 and handled >= 1.5, done.stdout
    assert ignored == "ignored"
