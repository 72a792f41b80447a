"""SGLang's torch_native attention on a hybrid (SWAKVPool) model: an SWA layer's K/V live in the
smaller SWA pool at translated slots, so its reads must go through the full->SWA mapping like its
writes (patches/sglang-0003-torch-native-swa-read-indices.patch). Unpatched, a full-pool index
past the SWA pool's size raises IndexError (the scheduler dies), and one inside it reads another
request's K/V silently."""

import types

import pytest
import torch

pytest.importorskip("sglang")

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 2, 8, 4
FULL_SIZE, SWA_SIZE = 64, 24


def make_backend():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=FULL_SIZE, size_swa=SWA_SIZE, page_size=1, dtype=torch.float32, head_num=KV_HEADS,
                     head_dim=HEAD_DIM, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                     enable_memory_saver=False)
    # as the SWA allocator keeps it: one slot per full index, plus the -1 sentinel
    mapping = torch.zeros(FULL_SIZE + 2, dtype=torch.int64)
    mapping[-1] = -1
    pool.register_mapping(mapping)
    req_to_token = torch.zeros(4, 128, dtype=torch.int32)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
                                   token_to_kv_pool=pool)
    return TorchNativeAttnBackend(runner), pool, mapping, req_to_token


def swa_layer(layer_id=0, window=WINDOW):
    from sglang.srt.layers.radix_attention import AttentionType

    return types.SimpleNamespace(layer_id=layer_id, tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS,
                                 qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, is_cross_attention=False,
                                 attn_type=AttentionType.DECODER, scaling=HEAD_DIM ** -0.5,
                                 sliding_window_size=window)


def reference(q, k, v, window):
    """Causal attention over the whole sequence, each query seeing keys [pos - window, pos]."""
    n = k.shape[0]
    qpos = torch.arange(n - q.shape[0], n).unsqueeze(1)
    kpos = torch.arange(n).unsqueeze(0)
    mask = (kpos <= qpos) & (kpos >= qpos - window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.movedim(0, 1).unsqueeze(0), k.movedim(0, 1).unsqueeze(0), v.movedim(0, 1).unsqueeze(0),
        attn_mask=mask, enable_gqa=True, scale=HEAD_DIM ** -0.5)
    return out.squeeze(0).movedim(0, 1)


@pytest.mark.parametrize("full_start", [40, 3], ids=["full-index-past-swa-pool", "full-index-inside-swa-pool"])
def test_swa_layer_reads_its_own_slots_in_extend_and_decode(full_start):
    torch.manual_seed(0)
    backend, pool, mapping, req_to_token = make_backend()
    n = 10
    full = torch.arange(full_start, full_start + n + 1)
    swa = torch.arange(n + 1, 0, -1)  # slots 11..1, unrelated to the full indices
    mapping[full] = swa
    req_to_token[2, :n + 1] = full.to(torch.int32)
    # another request's K/V sits at SWA slots equal to our full indices (when they fit)
    pool.swa_kv_pool.k_buffer[0].normal_()
    pool.swa_kv_pool.v_buffer[0].normal_()
    q, k, v = (torch.randn(n + 1, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    layer = swa_layer()

    batch = types.SimpleNamespace(out_cache_loc=full[:n], encoder_out_cache_loc=None,
                                  req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([n]),
                                  extend_prefix_lens=torch.tensor([0]), extend_seq_lens=torch.tensor([n]),
                                  encoder_lens=None)
    backend.init_forward_metadata(batch)
    out = backend.forward_extend(q[:n].reshape(n, -1), k[:n], v[:n], layer, batch).view(n, HEADS, HEAD_DIM)
    assert torch.equal(pool.swa_kv_pool.k_buffer[0][swa[:n]], k[:n])  # writes were always translated
    torch.testing.assert_close(out, reference(q[:n], k[:n], v[:n], WINDOW))

    step = types.SimpleNamespace(out_cache_loc=full[n:], encoder_out_cache_loc=None,
                                 req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([n + 1]),
                                 encoder_lens=None)
    backend.init_forward_metadata(step)
    out = backend.forward_decode(q[n:].reshape(1, -1), k[n:], v[n:], layer, step).view(1, HEADS, HEAD_DIM)
    torch.testing.assert_close(out, reference(q[n:], k, v, WINDOW))


def test_full_layer_reads_stay_untranslated():
    torch.manual_seed(1)
    backend, pool, mapping, req_to_token = make_backend()
    n = 6
    full = torch.arange(50, 50 + n)
    mapping[full] = torch.arange(1, n + 1)
    req_to_token[0, :n] = full.to(torch.int32)
    q, k, v = (torch.randn(n, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    layer = swa_layer(layer_id=1, window=-1)
    batch = types.SimpleNamespace(out_cache_loc=full, encoder_out_cache_loc=None, req_pool_indices=torch.tensor([0]),
                                  seq_lens=torch.tensor([n]), extend_prefix_lens=torch.tensor([0]),
                                  extend_seq_lens=torch.tensor([n]), encoder_lens=None)
    backend.init_forward_metadata(batch)
    out = backend.forward_extend(q.reshape(n, -1), k, v, layer, batch).view(n, HEADS, HEAD_DIM)
    assert torch.equal(pool.full_kv_pool.k_buffer[0][full], k)
    torch.testing.assert_close(out, reference(q, k, v, n))
