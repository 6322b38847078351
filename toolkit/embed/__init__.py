"""Embeddings: a model's pooled hidden states trained with a contrastive loss (InfoNCE over in-batch and
hard negatives, gathered with their gradients from every process), its config section, data layouts,
pooling, retrieval metrics and the sentence-transformers export. The run, backends, checkpoints and the
step machinery are the shared toolkit's."""
