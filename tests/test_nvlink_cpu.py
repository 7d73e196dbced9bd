"""nvlink/nvshmem backend checks that need no GPU (they run in CPU CI)."""
import pytest

from ep_plugin.errors import BackendUnavailableError


def compiled_module():
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")
    return ext.get_c()


def test_hidden_sizes_supported_and_refused():
    from ep_plugin.backends.nvlink import check_hidden
    for h in (256, 2048, 4096, 5120, 7168, 16384):
        check_hidden(h)
    for h in (0, 64, 1000, 7200, 16512, 100000, 7168.0):
        with pytest.raises(ValueError, match="hidden"):
            check_hidden(h)


def test_nvshmem_backend_reports_unavailable():
    """Without GPUs the internode backend imports, and says why it cannot serve a group."""
    from ep_plugin.backends import backend_class
    cls = backend_class("nvshmem")
    assert cls.name == "nvshmem"
    with pytest.raises(BackendUnavailableError):
        cls.check_group(None, 7168)


def test_nvlink_kernels_built_when_c_is():
    C = compiled_module()
    assert hasattr(C, "NvlinkRuntime")
    for name in ("notify", "stage", "pull", "combine", "open_peers", "close", "missing_ranks"):
        assert hasattr(C.NvlinkRuntime, name), name


def test_nvlink_limits_come_from_the_kernels():
    C = compiled_module()
    assert C.NVLINK_MAX_RANKS == 8 and C.NVLINK_MAX_TOPK == 32
    assert C.NVLINK_KERNEL_NAMES == {1: "notify", 2: "stage", 3: "pull", 4: "combine-send", 5: "combine-reduce"}


# The argument checks run before any CUDA call, so they are testable without a GPU; their messages
# carry the values that broke the rule.
@pytest.mark.parametrize("args,words", [
    ((0, 0, 9, 128, 7168, 64, 1.0), ["1..8 ranks", "world=9"]),
    ((0, 2, 2, 128, 7168, 64, 1.0), ["rank out of range", "rank=2", "world=2"]),
    ((0, 0, 4, 128, 7168, 6, 1.0), ["multiple of world", "num_experts=6", "world=4"]),
    ((0, 0, 2, 128, 7000, 64, 1.0), ["multiple of 128", "7000"]),
    ((0, 0, 2, 0, 7168, 64, 1.0), ["max_tokens must be positive", "got 0"]),
])
def test_nvlink_runtime_refuses_bad_arguments_with_values(args, words):
    C = compiled_module()
    with pytest.raises(ValueError) as err:
        C.NvlinkRuntime(*args)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_layout_refuses_bad_arguments_with_values():
    C = compiled_module()
    with pytest.raises(ValueError, match=r"num_ranks must be in \[1, 64\], got 65"):
        C.dispatch_layout(0, 0, 1, 65, 65, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="num_experts=10, num_ranks=4"):
        C.dispatch_layout(0, 0, 1, 4, 10, 0, 0, 0, 0)
