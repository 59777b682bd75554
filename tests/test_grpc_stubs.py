"""The committed stubs are exactly what grpcio-tools makes of the committed proto."""

from pathlib import Path

from serve_app.protos.generate import GENERATED, generate

PROTOS = Path(__file__).resolve().parent.parent / "serve_app" / "protos"


def test_committed_stubs_match_the_proto(tmp_path):
    generate(tmp_path)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (PROTOS / name).read_text(), (
            f"{name} is stale: run `python -m serve_app.protos.generate`"
        )
