"""transformers"""
