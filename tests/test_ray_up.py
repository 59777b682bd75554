"""`ray up` / `ray down` end to end with the shipped on-prem file (Ray's `local`
provider) against this machine's own test hosts: an sshd from Debian's package
on 127.0.0.1 (head) and 127.0.0.2 (worker), loopback only.

The cluster runs as a separate unprivileged user so that the `ray stop` which
`ray up` and `ray down` run over SSH can only touch that cluster's processes,
never the Ray instance the rest of the test session uses.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
USER = "seekray"
CLUSTER = "seekserve-e2e"
GCS_PORT = 6390


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (creates a user and runs sshd on port 22)"
    for tool in ("/usr/sbin/sshd", "rsync", "ssh-keygen", "useradd"):
        if not shutil.which(tool):
            return f"{tool} is not installed (.ci/run installs openssh-server and rsync)"
    for host in ("127.0.0.1", "127.0.0.2"):
        with socket.socket() as s:
            if s.connect_ex((host, 22)) == 0:
                return f"something already listens on {host}:22"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _as_user(shell: str) -> subprocess.CompletedProcess:
    return _run(["su", "-", USER, "-c", shell], timeout=60)


def _interpreter_for_user() -> str | None:
    """A Python of this venv's version that the unprivileged user can execute."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (os.path.realpath(sys._base_executable), shutil.which(version), f"/usr/bin/{version}",
                      f"/usr/local/bin/{version}"):
        if candidate and os.path.exists(candidate) and _as_user(f"{candidate} -c 'import sys'").returncode == 0:
            return candidate
    return None


def _user_ray_processes() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["username", "cmdline"]):
        if p.info["username"] == USER and "ray" in " ".join(p.info["cmdline"] or []) and "sshd" not in " ".join(
                p.info["cmdline"] or []):
            out.append(p)
    return out


@pytest.fixture(scope="module")
def hosts():
    # sshd reads authorized_keys as the test user: pytest's own tmp tree is private to root
    d = Path(tempfile.mkdtemp(prefix="seekserve-rayup-", dir="/tmp"))
    os.chmod(d, 0o755)
    if _run(["id", USER]).returncode != 0:
        _run(["useradd", "-m", "-s", "/bin/bash", USER], check=True)
    _run(["usermod", "-p", "*", USER], check=True)  # no password, but not locked: key login only
    home = Path(pwd.getpwnam(USER).pw_dir)
    python = _interpreter_for_user()
    if python is None:
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} the user {USER} may execute")
    # the user's `ray`: this venv's packages under an interpreter it can run
    site = sysconfig.get_paths()["purelib"]
    (home / "bin").mkdir(exist_ok=True)
    (home / "bin" / "ray").write_text(
        f"#!/bin/sh\nexport PYTHONPATH={site}:{ROOT} RAY_USAGE_STATS_ENABLED=0\n"
        f"exec {python} -c 'import sys; from ray.scripts.scripts import main; sys.exit(main())' \"$@\"\n")
    (home / "bin" / "ray").chmod(0o755)
    bashrc = home / ".bashrc"
    rest = [ln for ln in (bashrc.read_text().splitlines() if bashrc.exists() else []) if "seekserve-test" not in ln]
    # first line: Debian's .bashrc returns early for non-interactive shells
    bashrc.write_text("export PATH=$HOME/bin:$PATH RAY_USAGE_STATS_ENABLED=0  # seekserve-test\n" + "\n".join(rest))
    _run(["chown", "-R", f"{USER}:{USER}", str(home)], check=True)

    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id_ed25519")], check=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519")], check=True)
    shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
    os.chmod(d / "authorized_keys", 0o644)
    (d / "sshd_config").write_text("\n".join([
        "Port 22", "ListenAddress 127.0.0.1", "ListenAddress 127.0.0.2", f"HostKey {d}/host_ed25519",
        f"AuthorizedKeysFile {d}/authorized_keys", f"PidFile {d}/sshd.pid", "StrictModes no", "UsePAM no",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", f"AllowUsers {USER}", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(d / "sshd.log", "w"))
    # the local provider keeps its state next to the caller; head and caller share this machine
    state = Path("/tmp/ray")
    state.mkdir(exist_ok=True)
    for suffix, empty in (("lock", ""), ("state", "{}")):
        f = state / f"cluster-{CLUSTER}.{suffix}"
        f.write_text(empty)  # made writable for the head's autoscaler, which runs as the test user
        f.chmod(0o666)
    try:
        yield {"dir": d, "home": home}
    finally:
        sshd.terminate()
        sshd.wait(10)
        for p in _user_ray_processes():
            p.kill()
        shutil.rmtree(d, ignore_errors=True)


def _cluster_file(d: Path) -> Path:
    """The shipped cluster.local.yaml, pointed at the test hosts."""
    cfg = yaml.safe_load((ROOT / "cluster.local.yaml").read_text())
    cfg["cluster_name"] = CLUSTER
    cfg["provider"].update(head_ip="127.0.0.1", worker_ips=["127.0.0.2"])
    cfg["auth"] = {"ssh_user": USER, "ssh_private_key": str(d / "id_ed25519")}
    # offline: nothing to pip-install; check the runtime is there instead
    cfg["setup_commands"] = ["ray --version"]
    # both "hosts" share this machine (and the test session's own Ray): fixed ports must differ,
    # and stay outside Ray's worker port range (10002-19999)
    common = f"--num-cpus=1 --temp-dir=/tmp/ray-{USER}"
    cfg["head_start_ray_commands"] = [
        "ray stop",
        # Ray 2.60's autoscaler v2 never launches the local provider's workers (seen here); v1 does
        f"RAY_enable_autoscaler_v2=0 ray start --head --node-ip-address=127.0.0.1 --port={GCS_PORT} --num-gpus=0 --include-dashboard=false "
        f"--ray-client-server-port=20011 --dashboard-port=20012 --dashboard-agent-listen-port=20013 "
        f"{common} --autoscaling-config=~/ray_bootstrap_config.yaml",
    ]
    # no `ray stop` on the worker: here it is the head's machine and user, and would stop the head
    cfg["worker_start_ray_commands"] = [
        f"NCCL_NVLS_ENABLE=0 ray start --address=127.0.0.1:{GCS_PORT} --node-ip-address=127.0.0.2 --num-gpus=2 "
        f"--dashboard-agent-listen-port=20023 {common}",
    ]
    path = d / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _ray(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return _run([str(Path(sys.executable).parent / "ray"), *args], cwd=ROOT, timeout=timeout_s,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def test_ray_up_brings_head_and_worker_and_ray_down_cleans_up(hosts):
    d = hosts["dir"]
    cluster = _cluster_file(d)
    up = _ray("up", "-y", "--no-config-cache", str(cluster))
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    # file_mounts of the shipped file reached the head
    assert (hosts["home"] / "seekserve" / "configs" / "default.yaml").exists()

    status = ""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the head's autoscaler starts the worker over SSH
        r = _ray("exec", str(cluster), f"ray status --address=127.0.0.1:{GCS_PORT}", timeout_s=120)
        status = r.stdout
        if "0.0/2.0 GPU" in status and "0.0/2.0 CPU" in status:
            break
        time.sleep(5)
    assert "0.0/2.0 GPU" in status and "0.0/2.0 CPU" in status, status[-2000:]  # head 1 CPU + worker 1 CPU, 2 GPUs

    down = _ray("down", "-y", str(cluster))
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    deadline = time.monotonic() + 60
    while _user_ray_processes() and time.monotonic() < deadline:
        time.sleep(1)
    left = [" ".join(p.cmdline())[:120] for p in _user_ray_processes()]
    assert not left, left
