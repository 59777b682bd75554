"""The replica -> ingress stream item (Delta.to_wire): plain values only, same delta back."""

import msgpack

from serve_app.internal import Delta


def test_a_delta_crosses_as_msgpack_and_comes_back_equal():
    d = Delta(text="Par", token_ids=[12, 13], logprobs=[-0.1, -2.5], tokens=["P", "ar"],
              top_logprobs=[[("P", -0.1), ("L", -3.0)], [("ar", -2.5)]], finish_reason=None,
              prompt_tokens=7, completion_tokens=2)
    # no default hook: anything msgpack cannot pack natively (what Ray would pickle) raises here
    packed = msgpack.packb(d.to_wire())
    assert Delta.from_wire(msgpack.unpackb(packed)) == d
    bare = Delta(text="", token_ids=[5], logprobs=[-1.0], tokens=None, top_logprobs=None, finish_reason="stop",
                 prompt_tokens=3, completion_tokens=1)
    assert Delta.from_wire(msgpack.unpackb(msgpack.packb(bare.to_wire()))) == bare
