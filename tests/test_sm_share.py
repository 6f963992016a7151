"""ft_ops.sm_share: the scoped SM carveout the prefill GEMM runs under beside a copy kernel."""
import pytest
import torch

from ft_ops import sm_share

pytestmark = pytest.mark.skipif(not sm_share.carveout_supported(), reason="this torch has no SM carveout setting")


def test_carveout_set_inside_and_restored_after():
    assert torch._C._get_sm_carveout_experimental() is None
    with sm_share.sms_left_to_copies(8):
        assert torch._C._get_sm_carveout_experimental() == 8
    assert torch._C._get_sm_carveout_experimental() is None


def test_restored_when_the_body_raises():
    with pytest.raises(RuntimeError):
        with sm_share.sms_left_to_copies(4):
            raise RuntimeError("GEMM failed")
    assert torch._C._get_sm_carveout_experimental() is None


def test_no_copy_sms_changes_nothing_and_a_users_carveout_wins():
    with sm_share.sms_left_to_copies(0):
        assert torch._C._get_sm_carveout_experimental() is None
    torch._C._set_sm_carveout_experimental(20)
    try:
        with sm_share.sms_left_to_copies(8):
            assert torch._C._get_sm_carveout_experimental() == 20
        assert torch._C._get_sm_carveout_experimental() == 20
    finally:
        torch._C._set_sm_carveout_experimental(None)


def test_copy_kernel_sms_match_the_build():
    decode, layer = sm_share.copy_kernel_sms(False), sm_share.copy_kernel_sms(True)
    if torch.version.cuda is None or not torch._C._dispatch_has_kernel_for_dispatch_key(
            "freetoken::copy_experts", "CUDA"):
        assert (decode, layer) == (0, 0)
    else:
        assert decode >= 1 and layer >= 1
