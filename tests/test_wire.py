"""The replica -> ingress stream item (Delta.to_wire): packed by Ray's msgpack, nothing pickled."""

from ray._raylet import MessagePackSerializer

from serve_app.internal import Delta


def _through_ray_msgpack(value):
    pickled = []

    def fallback(obj):  # what Ray would pickle (it packs strict msgpack types only)
        pickled.append(type(obj).__name__)
        return len(pickled) - 1

    data = MessagePackSerializer.dumps(value, fallback)
    return MessagePackSerializer.loads(data, lambda i: None), pickled


def test_a_delta_crosses_as_plain_msgpack_and_comes_back_equal():
    d = Delta(text="Par", token_ids=[12, 13], logprobs=[-0.1, -2.5], tokens=["P", "ar"],
              top_logprobs=[[("P", -0.1), ("L", -3.0)], [("ar", -2.5)]], finish_reason=None,
              prompt_tokens=7, completion_tokens=2)
    bare = Delta(text="", token_ids=[5], logprobs=[-1.0], tokens=None, top_logprobs=None, finish_reason="stop",
                 prompt_tokens=3, completion_tokens=1)
    for delta in (d, bare):
        wire, pickled = _through_ray_msgpack(delta.to_wire())
        assert pickled == []
        assert Delta.from_wire(wire) == delta
    # the dataclass itself would have been pickled
    assert _through_ray_msgpack(d)[1] == ["Delta"]


def test_an_engine_chunk_crosses_the_engine_process_socket_whole():
    """The engine process's messages carry EngineChunks pickled by their fields in order (__reduce__):
    every field comes back, the optional ones set and unset."""
    import pickle
    from dataclasses import fields

    from serve_app.engines.base import EngineChunk

    full = EngineChunk(request_id="r1", token_ids=[3, 4], text="ab", logprobs=[-0.5, -1.5],
                       top_logprobs=[{3: -0.5, 9: -2.0}, {4: -1.5}], finish_reason="stop",
                       num_prompt_tokens=12, num_generated_tokens=2, queue_time_s=0.25)
    bare = EngineChunk("r2", [7], "", [-0.1], None, None, 5, 1)
    for chunk in (full, bare):
        back = pickle.loads(pickle.dumps(chunk))
        assert back == chunk and type(back) is EngineChunk
        assert all(getattr(back, f.name) == getattr(chunk, f.name) for f in fields(EngineChunk))
    # a class reference and one tuple of values (90 bytes here), not the object and a dict of its field
    # names (225 bytes): the replica loads one message of these every engine step
    assert len(pickle.dumps(bare)) < 120
