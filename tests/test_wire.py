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
