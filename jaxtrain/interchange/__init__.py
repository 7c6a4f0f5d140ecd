"""Interchange: weights in and out of jaxtrain, and sampling from them.

convert.py   Hugging Face safetensors <-> jaxtrain checkpoints (`jaxtrain convert`, train.init_from)
generate.py  `jaxtrain generate`: sample from a run, a checkpoint or an HF directory
"""
