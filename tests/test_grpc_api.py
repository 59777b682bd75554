"""gRPC beside HTTP: generated stubs against the real Serve app (SmolLM2 and a slow null engine)."""

import threading
import time

import grpc
import httpx
import pytest

from serve_app.protos import seekserve_pb2 as pb
from serve_app.protos import seekserve_pb2_grpc as pb_grpc
from tests.conftest import wait_for

QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def channel(serve_session):
    ch = grpc.insecure_channel(f"127.0.0.1:{serve_session['grpc_port']}")
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


def stub_and_md(channel, app):
    return pb_grpc.InferenceStub(channel), (("application", app["app"]),)


def ask(model, **kw):
    return pb.GenerateRequest(model=model, messages=[pb.ChatMessage(role="user", content=QUESTION)], **kw)


def test_unary_answers_paris(channel, smol_app):
    stub, md = stub_and_md(channel, smol_app)
    r = stub.Generate(ask(smol_app["model"], temperature=0, max_tokens=20), metadata=md, timeout=120)
    assert "Paris" in r.text
    assert r.finish_reason == "stop" and r.variant == "stable"
    assert r.usage.completion_tokens == len(r.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_reassembles_to_the_unary_text(channel, smol_app):
    stub, md = stub_and_md(channel, smol_app)
    req = pb.GenerateRequest(model=smol_app["model"], prompt="The three primary colours are", max_tokens=24,
                             temperature=0, logprobs=True, top_logprobs=2)
    unary = stub.Generate(req, metadata=md, timeout=120)
    msgs = list(stub.GenerateStream(req, metadata=md, timeout=120))
    assert "".join(m.text for m in msgs) == unary.text
    assert [t for m in msgs for t in m.token_ids] == list(unary.token_ids)
    assert msgs[-1].finish_reason == unary.finish_reason and msgs[-1].usage.completion_tokens == 24
    assert all(m.finish_reason == "" for m in msgs[:-1])
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == 24 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)


def test_list_models(channel, smol_app):
    stub, md = stub_and_md(channel, smol_app)
    r = stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=30)
    assert [(m.id, list(m.variants)) for m in r.models] == [(smol_app["model"], ["stable"])]


@pytest.mark.parametrize(
    "kwargs,code,needle",
    [
        (dict(temperature=5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(top_logprobs=3), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
        (dict(max_tokens=100000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ],
)
def test_invalid_argument(channel, smol_app, kwargs, code, needle):
    stub, md = stub_and_md(channel, smol_app)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(ask(smol_app["model"], **kwargs), metadata=md, timeout=30)
    assert e.value.code() == code
    assert needle in e.value.details()


def test_unknown_model_is_not_found(channel, smol_app):
    stub, md = stub_and_md(channel, smol_app)
    for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as e:
            call(ask("gpt-17"), metadata=md, timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "gpt-17" in e.value.details()


def test_queue_full_is_resource_exhausted(channel, slow_null_app):
    stub, md = stub_and_md(channel, slow_null_app)
    codes = []

    def one():
        try:
            stub.Generate(ask(slow_null_app["model"], max_tokens=5), metadata=md, timeout=30)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes


def _null_stats(app):
    return httpx.get(app["base"] + "/admin/engine-stats", timeout=30).json()[f"{app['model']}/stable"]


def _wait_idle(app):
    wait_for(lambda: _null_stats(app)["num_running"] == 0 and _null_stats(app)["num_waiting"] == 0, 30)


def test_client_deadline_is_honoured_and_aborts(channel, slow_null_app):
    stub, md = stub_and_md(channel, slow_null_app)
    _wait_idle(slow_null_app)
    before = _null_stats(slow_null_app)["aborted_requests"]
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(ask(slow_null_app["model"], max_tokens=40), metadata=md, timeout=0.8)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 1.8  # not the 4 s the generation would take
    wait_for(lambda: _null_stats(slow_null_app)["aborted_requests"] > before, 30)


def test_server_timeout_is_deadline_exceeded(channel, slow_null_app):
    stub, md = stub_and_md(channel, slow_null_app)
    _wait_idle(slow_null_app)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(ask(slow_null_app["model"], max_tokens=40), metadata=md, timeout=30)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not finish within 2 s" in e.value.details()


def test_client_cancel_aborts_the_stream(channel, slow_null_app):
    stub, md = stub_and_md(channel, slow_null_app)
    _wait_idle(slow_null_app)
    before = _null_stats(slow_null_app)["aborted_requests"]
    call = stub.GenerateStream(ask(slow_null_app["model"], max_tokens=40), metadata=md, timeout=30)
    first = next(call)
    assert first.text
    call.cancel()
    wait_for(lambda: _null_stats(slow_null_app)["aborted_requests"] > before, 30)


def test_ray_serve_health_rpc(channel):
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    health = serve_pb2_grpc.RayServeAPIServiceStub(channel)
    assert health.Healthz(serve_pb2.HealthzRequest(), timeout=10).message == "success"
    apps = health.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=10).application_names
    assert "smol" in apps


def test_standard_grpc_health_check(channel, smol_app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    md = (("application", smol_app["app"]),)
    for service in ("", "seekserve.v1.Inference", smol_app["model"]):
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=md, timeout=30)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), metadata=md, timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
