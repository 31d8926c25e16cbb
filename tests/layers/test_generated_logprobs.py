"""``generated_logprobs``: the trainer's log-prob of each generated token, the same bits whatever the
micro-batch split (one packed forward vs one sequence per micro-batch)."""
import torch

from areal_tik.layers.logprob_head import generated_logprobs, packed_logprobs
from areal_tik.layers.models import build_model
from areal_tik.layers.patch import patch_model


def test_split_and_single_pack_agree_and_pick_the_generated_tokens():
    torch.manual_seed(0)
    m = patch_model(build_model("tiny-qwen2", device="cpu", seed=4), kernels="tik")
    V = m.config.vocab_size
    pairs = [(torch.randint(3, V, (a,)).tolist(), torch.randint(3, V, (b,)).tolist()) for a, b in ((5, 3), (9, 6), (2, 4))]
    one = generated_logprobs(m, pairs, temperature=0.7)
    split = generated_logprobs(m, pairs, temperature=0.7, max_tokens_per_mb=1)     # one sequence per micro-batch
    assert [x.shape[0] for x in one] == [3, 6, 4]
    assert all(torch.equal(a, b) for a, b in zip(one, split))
    # the values are the rows of one packed forward that predict each generated token
    ids = torch.tensor(sum((p + o for p, o in pairs), []))
    cu = torch.tensor([0, 8, 23, 29], dtype=torch.int32)
    with torch.no_grad():
        full = packed_logprobs(m, ids, cu, temperature=0.7).float()
    assert torch.equal(one[1], full[8 + 9 - 1: 8 + 9 - 1 + 6])
    assert not torch.equal(one[1], full[8 + 9: 8 + 9 + 6])        # off by one position is different
