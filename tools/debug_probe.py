import fastattn
cfg = fastattn.AttentionConfig(batch=2, heads_q=4, seqlen_q=200, head_dim_qk=128, dtype="fp16", training=True)
print(fastattn.probe(cfg))
