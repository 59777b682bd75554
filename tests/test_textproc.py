"""Stop-string hold-back and UTF-8-safe incremental detokenisation."""

import pytest

from serve_app.engines.textproc import IncrementalDetokenizer, StopStringFilter


def _run(stops, pieces):
    f = StopStringFilter(stops)
    out, stopped = "", False
    for p in pieces:
        t, stopped = f.push(p)
        out += t
        if stopped:
            return out, True
    return out + f.flush(), False


def test_stop_string_split_across_pieces_is_never_emitted():
    out, stopped = _run(["END"], ["hello E", "N", "D tail"])
    assert (out, stopped) == ("hello ", True)


def test_false_prefix_is_released():
    out, stopped = _run(["END"], ["hello E", "x", " more"])
    assert (out, stopped) == ("hello Ex more", False)


def test_earliest_of_several_stops_wins():
    out, stopped = _run(["bb", "a"], ["xxbba"])
    assert (out, stopped) == ("xx", True)


def test_held_text_is_flushed_when_generation_ends():
    out, stopped = _run(["STOP"], ["abc ST"])
    assert (out, stopped) == ("abc ST", False)


@pytest.mark.parametrize(
    "text",
    ["北京是中国的首都。😀🎉👍🏽", "日本語のテキスト🍣と emoji 🧑‍💻 mixed", "한국어 ✨ café"],
)
def test_every_token_boundary_yields_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    assert full == text
    assert len(ids) > len(text) // 2, "the test string must split characters across tokens"
    d = IncrementalDetokenizer(tokenizer.backend_tokenizer)
    sent = ""
    held_at_some_boundary = False
    for t in ids:
        piece = d.push(t)
        held_at_some_boundary |= piece == ""
        piece.encode("utf-8")  # raises on lone surrogates
        assert "\ufffd" not in piece
        sent += piece
        # at every token boundary what was sent is a prefix of the full text
        assert full.startswith(sent), (sent, full)
    assert sent == full
    assert held_at_some_boundary, "no token split a character: the test proves nothing"
