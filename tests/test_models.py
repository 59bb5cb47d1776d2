"""The models on their own: shapes, names, causality, tying, init, learning, config checks."""
import math

import pytest
import torch
import torch.nn.functional as F

from ringtrain.models.linear import LinearRegression
from ringtrain.models.mlp import MLPClassifier
from ringtrain.models.transformer import Transformer


def tiny_transformer(**overrides) -> Transformer:
    values = dict(vocab_size=11, block_size=16, n_layers=2, n_heads=2, d_model=32, dropout=0.0)
    return Transformer(**{**values, **overrides})


# --- shapes and names ----------------------------------------------------------------------

def test_each_model_option_builds_its_class_from_its_target_node():
    from conftest import compose_config
    from ringtrain.config.builders import build_model

    for option, cls, dims in [("linear", LinearRegression, {"in_features": 1, "out_features": 1}),
                              ("mlp", MLPClassifier, {"in_features": 4, "num_classes": 2}),
                              ("transformer", Transformer, {"vocab_size": 5})]:
        node = dict(compose_config([f"model={option}"]).model)
        assert type(build_model(node, dims)) is cls


def test_linear_maps_n_by_in_to_n_by_out():
    assert LinearRegression(1, 1)(torch.randn(5, 1)).shape == (5, 1)
    assert LinearRegression(3, 2)(torch.randn(4, 3)).shape == (4, 2)


def test_linear_parameters_are_named_linear_weight_and_bias():
    names = dict(LinearRegression(3, 2).named_parameters())
    assert set(names) == {"linear.weight", "linear.bias"}
    assert names["linear.weight"].shape == (2, 3) and names["linear.bias"].shape == (2,)


def test_mlp_returns_logits_and_flattens_images():
    model = MLPClassifier(in_features=48, num_classes=3, hidden_sizes=[16, 8])
    assert model(torch.randn(7, 48)).shape == (7, 3)
    assert model(torch.randn(7, 3, 4, 4)).shape == (7, 3)
    linear_widths = [m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linear_widths == [16, 8, 3]


def test_transformer_returns_logits_per_position():
    assert tiny_transformer()(torch.randint(0, 11, (2, 9))).shape == (2, 9, 11)
    assert tiny_transformer()(torch.randint(0, 11, (3, 16))).shape == (3, 16, 11)  # T == block_size


# --- transformer structure -----------------------------------------------------------------

def test_transformer_is_causal_future_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = tiny_transformer(dropout=0.1).eval()
    idx = torch.randint(0, 11, (2, 12))
    changed = idx.clone()
    t = 6
    changed[:, t] = (idx[:, t] + 1) % 11
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])  # and it does see the change from t on


def test_tied_head_shares_the_embedding_storage():
    model = tiny_transformer(tie_weights=True)
    assert model.lm_head.weight is model.token_embedding.weight
    assert model.lm_head.weight.data_ptr() == model.token_embedding.weight.data_ptr()
    with torch.no_grad():
        model.token_embedding.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0].item() == 123.0


def test_untied_head_has_its_own_weights():
    tied, untied = tiny_transformer(tie_weights=True), tiny_transformer(tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.token_embedding.weight.data_ptr()
    extra = untied.lm_head.weight.numel()
    assert untied.num_parameters(exclude_embeddings=False) == tied.num_parameters(exclude_embeddings=False) + extra


def test_num_parameters_counts_shared_tensors_once_and_drops_lookup_tables():
    model = tiny_transformer(tie_weights=True)
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    assert model.num_parameters(exclude_embeddings=False) == total
    # Tied: the token table is the head's matmul weight, so only positions are excluded.
    assert model.num_parameters() == total - c.block_size * c.d_model
    untied = tiny_transformer(tie_weights=False)
    assert untied.num_parameters() == untied.num_parameters(exclude_embeddings=False) - (
        c.block_size + c.vocab_size
    ) * c.d_model


def test_flops_per_token_is_six_n_plus_attention_term():
    model = tiny_transformer()
    c = model.config
    assert model.flops_per_token() == 6 * model.num_parameters() + 12 * c.n_layers * c.d_model * c.block_size


def test_d_ff_zero_means_four_times_d_model():
    assert tiny_transformer(d_ff=0).blocks[0].mlp.fc_in.out_features == 4 * 32
    assert tiny_transformer(d_ff=40).blocks[0].mlp.fc_in.out_features == 40


def test_bias_false_removes_linear_and_layernorm_biases():
    model = tiny_transformer(bias=False)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]


def test_init_zeroes_biases_and_scales_residual_projections_down():
    torch.manual_seed(0)
    n_layers, d_model = 8, 64
    model = tiny_transformer(n_layers=n_layers, d_model=d_model, n_heads=4)
    block = model.blocks[0]
    assert block.attn.qkv.bias.abs().max() == 0 and block.mlp.fc_in.bias.abs().max() == 0
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.1)
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
    assert block.mlp.fc_out.weight.std().item() == pytest.approx(residual_std, rel=0.1)


def test_sequence_longer_than_block_size_raises_value_error():
    with pytest.raises(ValueError, match="block_size"):
        tiny_transformer(block_size=8)(torch.zeros(1, 9, dtype=torch.long))


# --- each model learns a tiny problem --------------------------------------------------------

def train(model: torch.nn.Module, loss_fn, steps: int, lr: float) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_linear_learns_y_equals_2x_plus_3():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 64).unsqueeze(1)
    y = 2 * x + 3
    model = LinearRegression(1, 1)
    losses = train(model, lambda m: F.mse_loss(m(x), y), steps=200, lr=0.1)
    assert losses[-1] < losses[0]
    assert abs(model.linear.weight.item() - 2) < 0.05
    assert abs(model.linear.bias.item() - 3) < 0.05


@pytest.mark.slow
def test_mlp_separates_two_blobs():
    torch.manual_seed(0)
    labels = torch.randint(0, 2, (128,))
    x = torch.randn(128, 4) * 0.5 + (labels.float().unsqueeze(1) * 2 - 1)  # blobs at -1 and +1
    model = MLPClassifier(in_features=4, num_classes=2, hidden_sizes=[16])
    losses = train(model, lambda m: F.cross_entropy(m(x), labels), steps=100, lr=0.01)
    assert losses[-1] < losses[0] / 4
    assert (model(x).argmax(1) == labels).float().mean().item() > 0.95


def test_transformer_memorises_a_repeating_sequence():
    torch.manual_seed(0)
    sequence = torch.arange(5).repeat(4)  # 0 1 2 3 4 0 1 2 ... : each next token is determined
    idx, targets = sequence[:-1].unsqueeze(0), sequence[1:].unsqueeze(0)
    model = tiny_transformer(vocab_size=5, block_size=19, n_layers=1)
    losses = train(
        model, lambda m: F.cross_entropy(m(idx).flatten(0, 1), targets.flatten()), steps=100, lr=3e-3
    )
    assert losses[-1] < losses[0] / 2


# --- config checks ---------------------------------------------------------------------------

TRANSFORMER_OK = dict(vocab_size=11)
LINEAR_OK = dict(in_features=1, out_features=1)
MLP_OK = dict(in_features=4, num_classes=2)

BAD_CONFIGS = [
    (LinearRegression, dict(LINEAR_OK, in_features=0), "model.in_features"),
    (LinearRegression, dict(LINEAR_OK, out_features=-1), "model.out_features"),
    (MLPClassifier, dict(MLP_OK, in_features=0), "model.in_features"),
    (MLPClassifier, dict(MLP_OK, num_classes=0), "model.num_classes"),
    (MLPClassifier, dict(MLP_OK, hidden_sizes=[]), "model.hidden_sizes"),
    (MLPClassifier, dict(MLP_OK, hidden_sizes=[64, 0]), "model.hidden_sizes"),
    (MLPClassifier, dict(MLP_OK, hidden_sizes=[64.5]), "model.hidden_sizes"),
    (MLPClassifier, dict(MLP_OK, dropout=1.0), "model.dropout"),
    (MLPClassifier, dict(MLP_OK, dropout=-0.1), "model.dropout"),
    (Transformer, dict(vocab_size=0), "model.vocab_size"),
    (Transformer, dict(TRANSFORMER_OK, block_size=0), "model.block_size"),
    (Transformer, dict(TRANSFORMER_OK, n_layers=0), "model.n_layers"),
    (Transformer, dict(TRANSFORMER_OK, n_heads=0), "model.n_heads"),
    (Transformer, dict(TRANSFORMER_OK, d_model=-8), "model.d_model"),
    (Transformer, dict(TRANSFORMER_OK, d_model=100, n_heads=3), "model.d_model"),
    (Transformer, dict(TRANSFORMER_OK, d_ff=-1), "model.d_ff"),
    (Transformer, dict(TRANSFORMER_OK, dropout=1.0), "model.dropout"),
    (Transformer, dict(TRANSFORMER_OK, dropout=-0.5), "model.dropout"),
]


@pytest.mark.parametrize(
    "model_class, values, field", BAD_CONFIGS, ids=[f"{c.__name__}-{v}" for c, v, _ in BAD_CONFIGS]
)
def test_bad_argument_value_raises_one_line_naming_the_field(model_class, values, field):
    with pytest.raises(ValueError) as err:
        model_class(**values)
    message = str(err.value)
    assert field in message and "\n" not in message


def test_head_divisibility_error_names_both_fields_and_the_fix():
    with pytest.raises(ValueError, match=r"model\.d_model=100 .*model\.n_heads=3.*d_model % n_heads == 0"):
        Transformer(vocab_size=11, d_model=100, n_heads=3)
