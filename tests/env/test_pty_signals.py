"""A sandbox's terminal starts its commands with the default signal dispositions, whatever the service inherited:
a service started in the background of a shell without job control ignores SIGINT and SIGQUIT, and without the
reset a Ctrl-C at the sandbox's terminal would not stop its foreground command (an ignored signal stays ignored
across exec)."""

import signal
import time

from orchard.env import SandboxClient
from orchard.env.embedded import serve


def test_ctrl_c_stops_the_terminal_s_command_under_a_service_that_ignores_sigint():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    try:
        with serve() as svc, SandboxClient(svc.url, svc.api_key) as client, client.create() as sb, \
                sb.pty("bash --norc --noprofile", rows=24, cols=80) as proc:
            # a command of the terminal ignores nothing (bash hands its children what it inherited)
            proc.write("grep -E '^SigIgn' /proc/self/status; echo go; sleep 30; echo not-interrupted\n")
            seen = proc.read_until(b"go\r\n", timeout=20)
            assert b"SigIgn:\t0000000000000000" in seen, seen
            time.sleep(0.2)  # the sleep has started
            proc.kill("INT")  # Ctrl-C at the terminal: the sleep ends, the shell lives on
            proc.write("echo after-$((2 + 3))\n")
            out = proc.read_until(b"after-5", timeout=20)
            assert b"not-interrupted" not in out
            proc.write("exit 5\n")
            assert proc.wait(timeout=20) == 5
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGQUIT, before[1])
