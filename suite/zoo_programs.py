"""The model zoo: training programs built from other libraries' own model code, for ``cobench trace zoo``.

Each entry is one training step — forward, loss, backward, optimiser — of a model a library ships,
at a small size for a CPU, randomly initialised from a config (no weights are downloaded), on
random data of the shapes the model takes. Nothing here is shaped around the replay: the point is
to judge generated benchmarks on programs nobody in this project wrote. ``build()`` returns
``(step, model)``; ``requires`` are the modules it imports (a program whose library is missing is
reported as not run, with the import error); ``world_size`` > 1 runs it under torchrun with gloo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Program = tuple[Callable[[], None], nn.Module]


@dataclass(frozen=True)
class ZooProgram:
    name: str
    library: str
    requires: tuple[str, ...]
    build: Callable[[], Program]
    description: str
    world_size: int = 1


def _trainer(model: nn.Module, loss: Callable[[], torch.Tensor], lr: float = 1e-4) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _tokens(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


# -- transformers -------------------------------------------------------------------------------------------
def bert_mlm() -> Program:
    """BERT masked-LM: 15 % of the tokens masked afresh each step, the rest ignored by the loss (-100)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=128)
    model = BertForMaskedLM(config).train()

    def loss() -> torch.Tensor:
        ids = _tokens(4, 32, config.vocab_size)
        masked = torch.rand(ids.shape) < 0.15
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return model(input_ids=ids.masked_fill(masked, 103), labels=labels).loss

    return _trainer(model, loss), model


def gpt2_lm() -> Program:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=2000, n_embd=128, n_layer=2, n_head=4, n_positions=128)
    model = GPT2LMHeadModel(config).train()

    def loss() -> torch.Tensor:
        ids = _tokens(4, 32, config.vocab_size)
        return model(input_ids=ids, labels=ids).loss

    return _trainer(model, loss), model


def t5_seq2seq() -> Program:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=2000, d_model=128, d_ff=256, d_kv=32, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config).train()

    def loss() -> torch.Tensor:
        return model(input_ids=_tokens(4, 32, config.vocab_size), labels=_tokens(4, 16, config.vocab_size)).loss

    return _trainer(model, loss), model


def qwen_moe_lm() -> Program:
    """A mixture-of-experts decoder (Qwen2-MoE): top-2 of 8 experts per token, a shared expert, routing by
    the router's scores each step."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=2000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, decoder_sparse_step=1)
    model = Qwen2MoeForCausalLM(config).train()

    def loss() -> torch.Tensor:
        ids = _tokens(4, 32, config.vocab_size)
        return model(input_ids=ids, labels=ids).loss

    return _trainer(model, loss), model


def vit_classify() -> Program:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=4, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=256, num_labels=10)
    model = ViTForImageClassification(config).train()

    def loss() -> torch.Tensor:
        return model(pixel_values=torch.randn(4, 3, 32, 32), labels=torch.randint(0, 10, (4,))).loss

    return _trainer(model, loss), model


def wav2vec2_ctc() -> Program:
    """Wav2Vec2 with a CTC head: a conv feature encoder over raw audio, time masking drawn each step (boolean
    indices into the hidden states), the CTC loss over label sequences of random lengths."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
                            conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                            mask_time_prob=0.1, mask_time_length=2, ctc_loss_reduction="mean", pad_token_id=0)
    model = Wav2Vec2ForCTC(config).train()

    def loss() -> torch.Tensor:
        audio = torch.randn(2, 4000)
        lengths = torch.randint(5, 15, (2,))
        labels = torch.randint(1, config.vocab_size, (2, 15))
        labels = labels.masked_fill(torch.arange(15)[None, :] >= lengths[:, None], -100)
        return model(input_values=audio, labels=labels).loss

    return _trainer(model, loss), model


# -- torchvision --------------------------------------------------------------------------------------------
def resnet18() -> Program:
    from torchvision.models import resnet18 as build

    model = build(num_classes=10).train()
    loss_fn = nn.CrossEntropyLoss()
    return _trainer(model, lambda: loss_fn(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,)))), model


def mobilenet_v3() -> Program:
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(num_classes=10).train()
    loss_fn = nn.CrossEntropyLoss()
    return _trainer(model, lambda: loss_fn(model(torch.randn(4, 3, 64, 64)), torch.randint(0, 10, (4,)))), model


def faster_rcnn() -> Program:
    """Faster R-CNN (MobileNetV3-FPN) trained with its own losses: anchor matching, proposal NMS, balanced
    box sampling — all decided by values, every step."""
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    model = fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None, num_classes=5, min_size=128,
                                                  max_size=128, rpn_pre_nms_top_n_train=300,
                                                  rpn_post_nms_top_n_train=100, box_batch_size_per_image=64).train()

    def loss() -> torch.Tensor:
        images, targets = [], []
        for _ in range(2):
            images.append(torch.rand(3, 128, 128))
            corners = torch.rand(3, 2) * 80
            boxes = torch.cat([corners, corners + 16 + torch.rand(3, 2) * 30], dim=1)
            targets.append({"boxes": boxes, "labels": torch.randint(1, 5, (3,))})
        return sum(model(images, targets).values())

    return _trainer(model, loss), model


# -- timm ---------------------------------------------------------------------------------------------------
def convnext_atto() -> Program:
    import timm

    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10).train()
    loss_fn = nn.CrossEntropyLoss()
    return _trainer(model, lambda: loss_fn(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,)))), model


def efficientnet_b0() -> Program:
    import timm

    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10).train()
    loss_fn = nn.CrossEntropyLoss()
    return _trainer(model, lambda: loss_fn(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,)))), model


# -- TorchRec -----------------------------------------------------------------------------------------------
def torchrec_dlrm() -> Program:
    """TorchRec's own DLRM, its tables sharded by DistributedModelParallel over the ranks (gloo), the tables
    trained by FBGEMM's fused optimiser in backward, the dense part by Adagrad; multi-hot ids of random
    lengths every step."""
    import torch.distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM, DLRMTrain

    features = [f"f{i}" for i in range(6)]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=5000, feature_names=[f])
              for i, f in enumerate(features)]
    dlrm = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                dense_in_features=13, dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 32, 1])
    train = DLRMTrain(dlrm)
    apply_optimizer_in_backward(torch.optim.SGD, train.model.sparse_arch.parameters(), {"lr": 0.01})
    model = DistributedModelParallel(train, device=torch.device("cpu"))
    dense = [p for name, p in model.named_parameters() if "sparse_arch" not in name]
    opt = torch.optim.Adagrad(dense, lr=0.01)
    batch = 64 if not dist.is_initialized() else 64 // dist.get_world_size() * dist.get_world_size()

    def step() -> None:
        from torchrec.datasets.utils import Batch

        lengths = torch.randint(1, 6, (len(features) * batch,))
        ids = torch.randint(0, 5000, (int(lengths.sum()),))
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=features, values=ids, lengths=lengths)
        loss, _ = model(Batch(dense_features=torch.randn(batch, 13), sparse_features=sparse,
                              labels=torch.randint(0, 2, (batch,)).float()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model


def gpt2_ddp() -> Program:
    """GPT-2 data-parallel over the ranks with PyTorch's DistributedDataParallel (gloo) at its default buckets:
    each bucket's gradients all-reduced as the backward makes them, waited for at its end."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=4000, n_embd=192, n_layer=4, n_head=4, n_positions=128)
    model = DistributedDataParallel(GPT2LMHeadModel(config).train())

    def loss() -> torch.Tensor:
        ids = _tokens(4, 48, config.vocab_size)
        return model(input_ids=ids, labels=ids).loss

    return _trainer(model, loss), model


# -- other libraries ----------------------------------------------------------------------------------------
def pyg_gcn() -> Program:
    """A two-layer GCN (PyTorch Geometric) on a random graph, trained on a boolean node mask."""
    from torch_geometric.nn import GCNConv

    class GCN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.conv2 = GCNConv(64, 64), GCNConv(64, 7)

        def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
            return self.conv2(torch.relu(self.conv1(x, edges)), edges)

    model = GCN().train()
    nodes = 2000
    x, edges = torch.randn(nodes, 64), torch.randint(0, nodes, (2, 10000))
    labels = torch.randint(0, 7, (nodes,))

    def loss() -> torch.Tensor:
        train_mask = torch.rand(nodes) < 0.3
        return nn.functional.cross_entropy(model(x, edges)[train_mask], labels[train_mask])

    return _trainer(model, loss, lr=1e-2), model


def diffusers_unet() -> Program:
    """A diffusion UNet (diffusers' UNet2DModel with attention blocks), trained on the noise-prediction loss
    at random timesteps of its DDPM scheduler."""
    from diffusers import DDPMScheduler, UNet2DModel

    model = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(16, 32), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D")).train()
    scheduler = DDPMScheduler(num_train_timesteps=1000)

    def loss() -> torch.Tensor:
        clean, noise = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
        t = torch.randint(0, 1000, (2,))
        return nn.functional.mse_loss(model(scheduler.add_noise(clean, noise, t), t).sample, noise)

    return _trainer(model, loss), model


ZOO: dict[str, ZooProgram] = {p.name: p for p in (
    ZooProgram("bert_mlm", "transformers", ("transformers",), bert_mlm, "BERT, masked LM"),
    ZooProgram("gpt2_lm", "transformers", ("transformers",), gpt2_lm, "GPT-2, causal LM"),
    ZooProgram("t5_seq2seq", "transformers", ("transformers",), t5_seq2seq, "T5, encoder-decoder"),
    ZooProgram("qwen_moe_lm", "transformers", ("transformers",), qwen_moe_lm, "Qwen2-MoE, mixture of experts"),
    ZooProgram("vit_classify", "transformers", ("transformers",), vit_classify, "ViT, image classification"),
    ZooProgram("wav2vec2_ctc", "transformers", ("transformers",), wav2vec2_ctc, "Wav2Vec2, audio CTC"),
    ZooProgram("resnet18", "torchvision", ("torchvision",), resnet18, "ResNet-18"),
    ZooProgram("mobilenet_v3", "torchvision", ("torchvision",), mobilenet_v3, "MobileNetV3-Small"),
    ZooProgram("faster_rcnn", "torchvision", ("torchvision",), faster_rcnn, "Faster R-CNN MobileNetV3-FPN"),
    ZooProgram("convnext_atto", "timm", ("timm",), convnext_atto, "ConvNeXt-Atto"),
    ZooProgram("efficientnet_b0", "timm", ("timm",), efficientnet_b0, "EfficientNet-B0"),
    ZooProgram("torchrec_dlrm", "torchrec", ("torchrec", "fbgemm_gpu"), torchrec_dlrm,
               "TorchRec DLRM, tables sharded over 2 ranks (gloo)", world_size=2),
    ZooProgram("gpt2_ddp", "torch.distributed", ("transformers",), gpt2_ddp,
               "GPT-2 data-parallel over 2 ranks (DDP, gloo)", world_size=2),
    ZooProgram("pyg_gcn", "torch_geometric", ("torch_geometric",), pyg_gcn, "GCN on a random graph"),
    ZooProgram("diffusers_unet", "diffusers", ("diffusers",), diffusers_unet, "UNet2D, DDPM noise loss"),
)}
