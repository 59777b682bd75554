"""A model's sampling defaults: what a request gets for the sampling fields it leaves out.

End to end on a real Serve app (SmolLM2 whose defaults are greedy, so a request that names no temperature
must answer exactly as one that asks for 0), over HTTP with the openai client and over gRPC; then the
config's rules.
"""

import grpc
import openai
import pytest
from ray import serve

from serve_app.config import ConfigError, parse_config
from serve_app.protos import seekserve_pb2 as pb
from serve_app.protos import seekserve_pb2_grpc as pb_grpc
from tests.conftest import deploy_app, smol_config

MODEL = "smol-greedy"
# an open question, so sampling at OpenAI's temperature 1.0 would wander from the greedy answer
QUESTION = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def greedy_app(serve_session):
    cfg = smol_config(MODEL, max_num_seqs=4)
    cfg["models"][0]["sampling_defaults"] = {"temperature": 0.0}
    deploy_app(cfg, name="greedy", route_prefix="/greedy")
    yield {
        "client": openai.OpenAI(base_url=serve_session["base"] + "/greedy/v1", api_key="unused", max_retries=0,
                                timeout=120),
        "grpc": f"127.0.0.1:{serve_session['grpc_port']}",
    }
    serve.delete("greedy")


def test_a_request_without_temperature_gets_the_models_default(greedy_app):
    client = greedy_app["client"]
    msgs = [{"role": "user", "content": QUESTION}]
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30)
    defaults = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30) for _ in range(3)]
    assert greedy.choices[0].message.content
    assert [d.choices[0].message.content for d in defaults] == [greedy.choices[0].message.content] * 3
    prompt = "The sea is"
    want = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20).choices[0].text
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=20).choices[0].text == want


def test_a_requests_own_temperature_wins_over_the_default(greedy_app):
    client = greedy_app["client"]
    msgs = [{"role": "user", "content": QUESTION}]
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=30)
    # seeded draws at 1.5 are reproducible, and (over 30 tokens of an open answer) not the greedy one
    hot = [client.chat.completions.create(model=MODEL, messages=msgs, temperature=1.5, seed=7, max_tokens=30)
           for _ in range(2)]
    assert hot[0].choices[0].message.content == hot[1].choices[0].message.content
    assert hot[0].choices[0].message.content != greedy.choices[0].message.content


def test_grpc_requests_get_the_same_default(greedy_app):
    with grpc.insecure_channel(greedy_app["grpc"]) as ch:
        stub, md = pb_grpc.InferenceStub(ch), (("application", "greedy"),)
        ask = dict(model=MODEL, messages=[pb.ChatMessage(role="user", content=QUESTION)], max_tokens=30)
        greedy = stub.Generate(pb.GenerateRequest(temperature=0, **ask), metadata=md, timeout=120)
        default = stub.Generate(pb.GenerateRequest(**ask), metadata=md, timeout=120)
    assert greedy.text and default.token_ids == greedy.token_ids


def test_sampling_defaults_are_validated_and_default_to_openais():
    cfg = smol_config(MODEL)
    assert parse_config(cfg).models[0].sampling_defaults.model_dump() == {"temperature": 1.0, "top_p": 1.0}
    for bad, field in (({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 5}, "top_k")):
        cfg["models"][0]["sampling_defaults"] = bad
        with pytest.raises(ConfigError, match=rf"models\[0\]\.sampling_defaults\.{field}"):
            parse_config(cfg)
