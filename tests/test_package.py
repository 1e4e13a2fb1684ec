import subprocess
import sys

import orchard


def test_version_and_typed_marker():
    from importlib.resources import files

    assert orchard.__version__
    assert files("orchard").joinpath("py.typed").is_file()


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "orchard", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "usage: orchard" in out.stdout
