"""nvlink/nvshmem backend checks that need no GPU (they run in CPU CI)."""
import pytest

from ep_plugin.errors import BackendUnavailableError


def test_hidden_sizes_supported_and_refused():
    from ep_plugin.backends.nvlink import check_hidden
    for h in (256, 2048, 4096, 5120, 7168, 16384):
        check_hidden(h)
    for h in (0, 64, 1000, 7200, 16512, 100000, 7168.0):
        with pytest.raises(ValueError, match="hidden"):
            check_hidden(h)


def test_nvshmem_backend_reports_unavailable():
    from ep_plugin.backends import _nvshmem_module
    with pytest.raises(BackendUnavailableError, match="nvshmem"):
        _nvshmem_module()


def test_nvlink_kernels_built_when_c_is():
    import ep_plugin._ext as ext
    if not ext.has_c():
        pytest.skip("ep_plugin._C is not built")
    C = ext.get_c()
    assert hasattr(C, "NvlinkRuntime")
    for name in ("notify", "stage", "pull", "combine", "open_peers", "close", "missing_ranks"):
        assert hasattr(C.NvlinkRuntime, name), name
