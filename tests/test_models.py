import pytest
import torch

from pfl_core.models import MODELS, build_model, count_parameters
from pfl_core.training import forward, model_params


@pytest.mark.parametrize(
    "name, shape, classes, expected",
    [
        ("cafeme_cnn_a", (1, 28, 28), 10, 583_242),  # CAFeMe spec, model A
        ("cafeme_cnn_a", (1, 28, 28), 62, 609_918),
        ("cafeme_cnn_b", (3, 32, 32), 10, 1_006_858),  # CAFeMe spec, model B
        ("mlr", (784,), 10, 7_850),  # CGPFL spec
        ("dnn", (784,), 10, 101_770),
    ],
)
def test_parameter_counts_match_the_specs(name, shape, classes, expected):
    model = build_model(name, shape, classes)
    assert count_parameters(model) == expected
    logits = model(torch.rand(4, *shape))
    assert logits.shape == (4, classes)


def test_dnn_width_switch():
    assert count_parameters(build_model("dnn", (784,), 10, hidden=100)) == 784 * 100 + 100 + 100 * 10 + 10


def test_batchnorm_keeps_no_buffers_and_uses_batch_statistics():
    model = build_model("cafeme_cnn_a", (1, 28, 28), 10)
    assert list(model.buffers()) == []
    model.eval()
    x = torch.rand(8, 1, 28, 28)
    # batch statistics even in eval mode: a sample's output depends on the rest of the batch
    alone = model(x[:4])[0]
    together = model(torch.cat([x[:4], 5 * x[4:]]))[0]
    assert not torch.allclose(alone, together)


def test_functional_call_matches_module_forward():
    model = build_model("cafeme_cnn_b", (3, 32, 32), 10)
    x = torch.rand(5, 3, 32, 32)
    assert torch.allclose(forward(model, model_params(model), x), model(x), atol=1e-6)


def test_wrong_input_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="expects inputs of shape"):
        build_model("cafeme_cnn_a", (3, 32, 32), 10)


def test_unknown_model_lists_allowed_names():
    with pytest.raises(KeyError, match="allowed: .*cafeme_cnn_a"):
        MODELS.get("resnet999")
