/* paged_prefill.c over a bfloat16 KV cache: paged_prefill_bf16 and write_kv_bf16 (see kv.h). */
#define KV_KIND 1
#include "paged_prefill.c"
