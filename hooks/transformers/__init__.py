"""The transformers engine adapter (``statediff record --engine transformers``): transformers has
no prefix cache, so the adapter serves a conversation itself from a block-aligned prefix store
(``prefix_store``, transformers 5.19 cache internals) and records in the vLLM adapter's layouts
(``adapter``); DFlash drafters through transformers' own classes (``dflash``)."""
