/* paged_decode.c over a bfloat16 KV cache: paged_decode_bf16 and decode_heads_bf16 (see kv.h). */
#define KV_KIND 1
#include "paged_decode.c"
