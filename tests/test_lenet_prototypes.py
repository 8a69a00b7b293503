"""LeNet models (MetaVers spec "Models") and the shared prototype primitives."""
import pytest
import torch

from pfl_core.models import build_model, count_parameters
from pfl_core.prototypes import class_prototypes, nearest_prototype, prototype_logits, squared_distances
from pfl_core.training import embed, forward, model_params


def test_le_embedding_has_the_spec_parameter_count_and_84d_output():
    model = build_model("le_embedding", (3, 32, 32), 10)
    assert count_parameters(model) == 120_332
    out = forward(model, model_params(model), torch.randn(4, 3, 32, 32))
    assert out.shape == (4, 84)
    assert (out < 0).any()  # no final ReLU


def test_lenet_embedding_is_the_relu_input_of_its_classifier():
    torch.manual_seed(0)
    model = build_model("lenet", (3, 32, 32), 10)
    params = model_params(model)
    x = torch.randn(5, 3, 32, 32)
    features = embed(model, params, x)
    assert features.shape == (5, 84) and (features >= 0).all()
    torch.testing.assert_close(forward(model, params, x), features @ params["fc3.weight"].T + params["fc3.bias"])
    assert count_parameters(model) == 120_332 + 84 * 10 + 10


def test_embed_rejects_a_model_without_an_embedding():
    model = build_model("mlr", (1, 28, 28), 10)
    with pytest.raises(ValueError, match="no feature embedding"):
        embed(model, model_params(model), torch.randn(2, 1, 28, 28))


def test_lenet_rejects_other_input_shapes():
    with pytest.raises(ValueError, match=r"\(3, 32, 32\)"):
        build_model("le_embedding", (1, 28, 28), 10)


def test_prototypes_and_distances_against_a_hand_computation():
    emb = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1, 1])
    protos = class_prototypes(emb, labels, 3)
    torch.testing.assert_close(protos, torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, 0.0]]))
    d = squared_distances(emb, protos[:2])
    torch.testing.assert_close(d, torch.tensor([[1.0, 9.0], [1.0, 13.0], [17.0, 1.0], [5.0, 1.0]]))
    torch.testing.assert_close(prototype_logits(emb, protos[:2]), -d)
    assert nearest_prototype(emb, protos[:2]).tolist() == [0, 0, 1, 1]
    # restricted to class 1 only, every row picks class 1 (even the zero prototype 2 is excluded)
    allowed = torch.tensor([False, True, False])
    assert nearest_prototype(emb, protos, allowed).tolist() == [1, 1, 1, 1]


def test_prototypes_run_under_vmap():
    emb = torch.randn(3, 6, 4)
    labels = torch.tensor([0, 1, 0, 1, 1, 0])
    batched = torch.func.vmap(lambda e: class_prototypes(e, labels, 2))(emb)
    for i in range(3):
        torch.testing.assert_close(batched[i], class_prototypes(emb[i], labels, 2))
    stacked_labels = torch.stack([labels, 1 - labels, labels.flip(0)])  # labels batched too
    batched = torch.func.vmap(lambda e, y: class_prototypes(e, y, 2))(emb, stacked_labels)
    for i in range(3):
        torch.testing.assert_close(batched[i], class_prototypes(emb[i], stacked_labels[i], 2))
