/* paged_decode.c over a float8 e4m3 KV cache: paged_decode_e4m3 and decode_heads_e4m3 (see kv.h). */
#define KV_KIND 2
#include "paged_decode.c"
