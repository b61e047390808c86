"""lmpretrain: readable, resumable pretraining recipes for transformers causal LMs."""
