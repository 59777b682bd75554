"""NCCL env validation against documented ranges, and the shipped profiles."""

import pytest

from cluster.nccl import TOPOLOGIES, NcclConfigError, check, detect, profile, validate

GOLDEN_SET = {
    "NCCL_ALGO": "ring",
    "NCCL_PROTO": "ll128",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_NTHREADS": "8",
    "NCCL_NTHREADS": "8",
}


def test_golden_set_is_rejected_for_nthreads_and_warned_for_the_rest():
    findings = validate(GOLDEN_SET)
    errors = {f.var for f in findings if f.level == "error"}
    warnings = {f.var for f in findings if f.level == "warning"}
    assert errors == {"NCCL_NTHREADS"}
    assert warnings >= {"NCCL_ALGO", "NCCL_PROTO", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_NTHREADS"}
    with pytest.raises(NcclConfigError, match="NCCL_NTHREADS: 8 is not one of"):
        check(GOLDEN_SET)


def test_golden_set_without_nthreads_passes_with_warnings():
    env = {k: v for k, v in GOLDEN_SET.items() if k != "NCCL_NTHREADS"}
    warnings = check(env)
    assert len(warnings) == 5 and all(w.level == "warning" for w in warnings)


@pytest.mark.parametrize(
    "env,var",
    [
        ({"NCCL_NTHREADS": "1024"}, "NCCL_NTHREADS"),
        ({"NCCL_NTHREADS": "lots"}, "NCCL_NTHREADS"),
        ({"NCCL_SOCKET_NTHREADS": "17"}, "NCCL_SOCKET_NTHREADS"),
        ({"NCCL_SOCKET_NTHREADS": "0"}, "NCCL_SOCKET_NTHREADS"),
        ({"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "5"}, "NCCL_SOCKET_NTHREADS"),
        ({"NCCL_PROTO": "LL,fast"}, "NCCL_PROTO"),
        ({"NCCL_ALGO": "Ring,Star"}, "NCCL_ALGO"),
        ({"NCCL_IB_DISABLE": "yes"}, "NCCL_IB_DISABLE"),
        ({"NCCL_NVLS_ENABLE": "1"}, "NCCL_NVLS_ENABLE"),
        ({"NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "4"}, "NCCL_MIN_NCHANNELS"),
        ({"NCCL_P2P_LEVEL": "FAR"}, "NCCL_P2P_LEVEL"),
    ],
)
def test_out_of_range_values_are_errors(env, var):
    errors = [f for f in validate(env) if f.level == "error"]
    assert [f.var for f in errors] == [var], errors


@pytest.mark.parametrize(
    "env",
    [
        {"NCCL_ALGO": "^NVLS", "NCCL_PROTO": "LL,Simple"},
        {"NCCL_ALGO": "Tree,Ring", "NCCL_PROTO": "^LL128"},
        {"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "4"},
        {"NCCL_NTHREADS": "512", "NCCL_DEBUG": "WARN"},
    ],
)
def test_valid_values_pass(env):
    assert [f for f in validate(env, topology="multi_node_tcp") if f.level == "error"] == []


def test_multicast_only_where_allowed():
    assert check({"NCCL_NVLS_ENABLE": "1"}, multicast_allowed=True) == []
    assert profile("nvlink")["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_profile_is_valid_and_warning_free(topology):
    env = profile(topology, socket_ifname="eth0", ib_hca="mlx5")
    assert validate(env, topology) == []


def test_unknown_topology_lists_valid_ones():
    with pytest.raises(NcclConfigError, match="nvlink, pcie"):
        profile("infiniband-please")


def test_detect_without_nvml_is_a_result_not_a_crash():
    report = detect()
    assert report.topology in (None, "pcie", "nvlink")
    assert report.reason
    assert detect(num_nodes=2, has_infiniband=False).topology == "multi_node_tcp"
