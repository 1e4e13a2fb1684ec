"""A simulated kubelet: runs each pod of the emulator as real local processes, on a loopback address of its own.

For every pod created: the status goes Pending (scheduled) -> the pod gets an IP -> the init containers run to
completion -> the main container starts -> Running -> Ready once its readiness probe (HTTP GET) answers 200.
The containers' commands run on this machine with their volume mount paths mapped to a directory per pod and
volume, `0.0.0.0` mapped to the pod's IP, and their env built from the pod spec (values and `secretKeyRef`s) and
nothing else. The sandbox container's `python3` is this interpreter run with `-S` (no
site-packages): the injected agent must need nothing but the standard library, as in a bare image.

Pod IPs are 127.X.Y.N on loopback, X.Y drawn at random per kubelet, and an address on which something already
listens on the pod's agent port is skipped: every pod's agent binds the same port (the backend's `agent_port`),
so two kubelets on one machine (two test runs at once) or an agent some other run left behind would otherwise
meet on one address, the newer agent dying at bind (exit code 1) while the readiness probe is answered by the
older. The containers are started under `setpriv --pdeathsig KILL`: they die with the process that runs the
kubelet, however it ends (a real pod's processes do not outlive its node either). What an agent printed before
it exited on its own is kept in `exits` and on the pod's status message.

A pod being deleted gracefully (Terminating: `deletionTimestamp` set) is stopped as a kubelet stops it: SIGTERM to
its containers, SIGKILL once its grace period has passed, then the pod is removed from the API (a DELETE with
grace 0). A pod deleted with grace 0 is gone from the API at once; its containers are killed when the kubelet
hears of it.

Faults: `slow_ready_s` delays readiness, `never_ready` leaves a pod waiting with a reason (an image that cannot
be pulled), `evict` kills a pod's processes and marks it Failed/Evicted, `lose_node` marks it Unknown,
`set_ready` flips a live pod's Ready condition (a readiness probe that times out under load), `slow_kill_s`
keeps a deleted pod's containers running that long after the API has let it go (a busy or unreachable node).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from k8s_emulator import ApiEmulator

REPO = str(Path(__file__).resolve().parents[3])
KEEP_LOGS_ENV = "ORCHARD_SIM_KEEP_POD_LOGS"
DIE_WITH_KUBELET = ["setpriv", "--pdeathsig", "KILL", "--"]
"""Prefix of every container's argv: the process is SIGKILLed when the kubelet's thread that started it ends."""


def port_taken(ip: str, port: int) -> bool:
    """Whether something listens on (or holds) `ip:port`; binding as a server does (so TIME_WAIT is no hold)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


class SimulatedKubelet:
    def __init__(self, api: ApiEmulator, workdir: str | os.PathLike[str]) -> None:
        self.api = api
        self.workdir = Path(workdir)
        self.slow_ready_s: dict[str, float] = {}
        """Sandbox id -> seconds its readiness is held back."""
        self.never_ready: dict[str, tuple[str, str]] = {}
        """Sandbox id -> (reason, message) its container waits with forever."""
        self.slow_kill_s = 0.0
        """Seconds between hearing of a deletion and stopping the pod's containers."""
        if shutil.which("setpriv") is None:
            raise RuntimeError("the simulated kubelet needs util-linux's setpriv (its pods die with it)")
        self.subnet = f"127.{secrets.randbelow(254) + 1}.{secrets.randbelow(256)}"
        """This kubelet's pod IPs are `subnet`.2 to `subnet`.254."""
        self.processes: dict[str, list[subprocess.Popen[bytes]]] = {}
        self.ips: dict[str, str] = {}
        """Pod name -> IP of every pod this kubelet runs."""
        self.exits: dict[str, tuple[int, str]] = {}
        """Pod name -> (exit code, output) of every agent that exited on its own (its pod then Failed)."""
        self.keep_logs = os.environ.get(KEEP_LOGS_ENV) == "1"
        """Keep each deleted pod's agent log in `workdir`/logs (a debugging switch: a real kubelet drops them)."""
        self._next_ip = 2
        self._lock = threading.Lock()
        api.on_event.append(self._on_event)

    def _on_event(self, kind: str, resource: str, pod: dict[str, Any]) -> None:
        if resource != "pods":
            return
        if kind == "ADDED":
            threading.Thread(target=self._run_pod, args=(pod,), daemon=True).start()
        elif kind == "DELETED" and self.slow_kill_s:
            threading.Timer(self.slow_kill_s, self._kill, args=(pod["metadata"]["name"],)).start()
        elif kind == "DELETED":
            self._kill(pod["metadata"]["name"])
        elif kind == "MODIFIED" and pod["metadata"].get("deletionTimestamp"):
            threading.Thread(target=self._terminate, args=(pod,), daemon=True).start()

    def _terminate(self, pod: dict[str, Any]) -> None:
        """Stop a Terminating pod: SIGTERM, SIGKILL after its grace period, then remove it from the API."""
        meta = pod["metadata"]
        time.sleep(self.slow_kill_s)
        with self._lock:
            procs = list(self.processes.get(meta["name"], []))
            self.processes[meta["name"]] = []  # what exits now was stopped, not failed: no Failed status
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + float(meta.get("deletionGracePeriodSeconds") or 0)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        self._kill(meta["name"], procs)
        self.api.delete("pods", meta["namespace"], meta["name"], grace_s=0)

    def _kill(self, name: str, stopping: list[subprocess.Popen[bytes]] | None = None) -> None:
        with self._lock:
            procs = [*(stopping or []), *self.processes.pop(name, [])]
            self.ips.pop(name, None)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.workdir / name, ignore_errors=True)
        if not self.keep_logs:
            (self.workdir / "logs" / f"{name}.log").unlink(missing_ok=True)  # what a deleted pod leaves: nothing

    def stop(self) -> None:
        for name in list(self.processes):
            self._kill(name)

    def live_pods(self) -> list[str]:
        with self._lock:
            return [n for n, ps in self.processes.items() if any(p.poll() is None for p in ps)]

    # -- faults ---------------------------------------------------------------------------------------------

    def evict(self, namespace: str, name: str, message: str = "The node was low on resource: memory.") -> None:
        self._kill(name)
        self.api.update_status(namespace, name, {"phase": "Failed", "reason": "Evicted", "message": message})

    def set_ready(self, namespace: str, name: str, ready: bool) -> None:
        """Report a running pod Ready or not, its agent untouched (a readiness probe that timed out under load
        makes a real kubelet do this, and the next probe that passes undoes it)."""
        pod = self.api.get("pods", namespace, name)
        assert pod is not None, name
        status = pod["status"]
        for c in status.get("conditions", []):
            if c["type"] == "Ready":
                c["status"] = "True" if ready else "False"
        for c in status.get("containerStatuses", []):
            c["ready"] = ready
        self.api.update_status(namespace, name, status)

    def lose_node(self, namespace: str, name: str) -> None:
        self._kill(name)
        self.api.update_status(namespace, name, {"phase": "Unknown", "reason": "NodeLost",
                                                 "message": "Node sim-node-1 which was running pod is unresponsive"})

    # -- a pod's life ---------------------------------------------------------------------------------------

    def _assign_ip(self, name: str, port: int) -> str | None:
        """The next address of the subnet that no pod of ours has and on which nothing holds `port`."""
        with self._lock:
            for _ in range(253):
                ip = f"{self.subnet}.{self._next_ip}"
                self._next_ip = self._next_ip + 1 if self._next_ip < 254 else 2
                if ip not in self.ips.values() and not port_taken(ip, port):
                    self.ips[name] = ip
                    self.processes[name] = []
                    return ip
        return None

    def _status(self, namespace: str, name: str, phase: str, ip: str | None, ready: bool,
                containers: list[dict[str, Any]] | None = None) -> bool:
        # the fields the API always fills in (the official client's models require them)
        for c in containers or []:
            c.update(image="sim", imageID="sim", restartCount=0, ready=c.get("ready", False))
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": containers or [],
        }
        if ip:
            status["podIP"] = ip
            status["hostIP"] = "127.0.0.1"
        return self.api.update_status(namespace, name, status)

    def _argv(self, container: dict[str, Any], mounts: dict[str, str], ip: str, sandbox: bool) -> list[str]:
        out = []
        for arg in [*container.get("command", []), *container.get("args", [])]:
            for path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if arg == path or arg.startswith(path + "/"):
                    arg = local + arg[len(path):]
                    break
            out.append(ip if arg == "0.0.0.0" else arg)
        if out and out[0] in ("python", "python3"):
            out[0:1] = [sys.executable, "-S"] if sandbox else [sys.executable]
        if sandbox:  # no mount namespace here: tell the agent which paths its pod would see the workspace at
            out += [f"--alias={path}" for path, local in mounts.items() if local.endswith("/workspace")]
        return DIE_WITH_KUBELET + out

    def _env(self, namespace: str, container: dict[str, Any]) -> dict[str, str] | None:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                secret = self.api.get("secrets", namespace, ref["name"])
                if secret is None:
                    return None

                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        return env

    def _run_pod(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name = meta["namespace"], meta["name"]
        sandbox = (meta.get("labels") or {}).get("orchard.dev/sandbox", "")
        main = spec["containers"][0]
        ip = self._assign_ip(name, main["readinessProbe"]["httpGet"]["port"])
        if ip is None:
            self._status(ns, name, "Pending", None, False, [{"name": main["name"], "state": {"waiting": {
                "reason": "ContainerCreating", "message": f"no free address in {self.subnet}.0/24"}}}])
            return
        if not self._status(ns, name, "Pending", ip, False):  # deleted before it started: free its address
            self._kill(name)
            return
        if sandbox in self.never_ready:
            reason, message = self.never_ready[sandbox]
            self._status(ns, name, "Pending", ip, False,
                         [{"name": main["name"], "ready": False, "state": {"waiting": {"reason": reason,
                                                                                       "message": message}}}])
            return
        root = self.workdir / name
        volumes = {}
        for v in spec.get("volumes", []):
            # the workspace keeps its mount path's last part, so `pwd` inside ends as in the pod
            volumes[v["name"]] = str(root / v["name"] / ("workspace" if v["name"] == "workspace" else "dir"))
            os.makedirs(volumes[v["name"]], exist_ok=True)
        for init in spec.get("initContainers", []):
            mounts = {m["mountPath"]: volumes[m["name"]] for m in init.get("volumeMounts", [])}
            env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": REPO}
            done = subprocess.run(self._argv(init, mounts, ip, False), env=env, capture_output=True)
            if done.returncode != 0:
                self._status(ns, name, "Failed", ip, False, [{"name": init["name"], "state": {"terminated": {
                    "exitCode": done.returncode, "reason": "Error", "message": done.stderr.decode()[-200:]}}}])
                return
        mounts = {m["mountPath"]: volumes[m["name"]] for m in main.get("volumeMounts", [])}
        env = self._env(ns, main)
        if env is None:
            self._status(ns, name, "Pending", ip, False, [{"name": main["name"], "state": {"waiting": {
                "reason": "CreateContainerConfigError", "message": "secret not found"}}}])
            return
        workdir = mounts.get(main.get("workingDir", ""), str(root))
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self._argv(main, mounts, ip, True), env=env, cwd=workdir, start_new_session=True,
                                    stdout=log, stderr=subprocess.STDOUT)
        with self._lock:
            if name not in self.processes:  # deleted while starting
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return
            self.processes[name].append(proc)
        running = [{"name": main["name"], "ready": False, "state": {"running": {}}}]
        self._status(ns, name, "Running", ip, False, running)
        time.sleep(self.slow_ready_s.get(sandbox, 0.0))
        probe = main["readinessProbe"]["httpGet"]
        url = f"http://{ip}:{probe['port']}{probe['path']}"
        while proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        if proc.poll() is None:
            ready = [{"name": main["name"], "ready": True, "state": {"running": {}}}]
            self._status(ns, name, "Running", ip, True, ready)
        proc.wait()
        with self._lock:
            still_ours = any(p is proc for p in self.processes.get(name, []))
        if still_ours:  # it exited on its own: restartPolicy Never makes the pod Failed
            said = log_path.read_bytes().decode(errors="replace").strip()
            self.exits[name] = (proc.returncode, said)
            self._status(ns, name, "Failed", ip, False, [{"name": main["name"], "state": {"terminated": {
                "exitCode": proc.returncode, "reason": "Error", "message": said[-300:]}}}])
