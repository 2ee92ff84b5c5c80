#version 450
// A pass's routed (token, expert) pairs grouped by expert, for the experts'
// matvecs (matvec.comp with ARENA and order_off): pair p = token * k + j,
// the token's j-th chosen id, goes to position at = (the pairs of smaller
// ids) + (its rank among its own id's pairs) of the order, stored as float
// bits at order_off + (at / k) * tok_stride + at % k (k entries per token
// block). A counting sort in one workgroup: count per id, an exclusive
// prefix sum over the ids, then each pair takes the next place of its id.
// The order among one id's pairs is whatever the atomics give; no value
// depends on it (each pair's sums are its own), only which pairs of a
// matvec tile share weights.
//
// With tiles_off, also the tiles of the order for shaders/mm.comp, each
// within one id's pairs: at tiles_off their number T, then T (first entry,
// entries) pairs of float bits, an id's pairs in tiles of up to `tile`, the
// ids in order (so that a tile decodes one expert's weights once, and an
// expert's pairs are never split across more tiles than they fill).
#define WG 256
#define MAX_IDS 1040
#include "common.glsl"

layout(push_constant) uniform Push {
    uint ids_off;     // token 0's chosen ids (k per token, float bits)
    uint order_off;   // token 0's k entries of the order
    uint tok_stride;
    uint k;           // pairs per token
    uint n;           // tokens of the pass
    uint n_ids;       // ids are below this (routed experts, plus the shared one in the arena)
    uint tiles_off;   // the tile table (0: none)
    uint tile;        // entries of a tile at most
} pc;

shared uint count[MAX_IDS];
shared uint partial[WG / 4];
shared uint tiles_partial[WG / 4];

uint id_of(uint p) {
    return min(floatBitsToUint(s[pc.ids_off + (p / pc.k) * pc.tok_stride + p % pc.k]), pc.n_ids - 1u);
}

void main() {
    uint t = gl_LocalInvocationIndex, pairs = pc.n * pc.k;
    for (uint e = t; e < pc.n_ids; e += WG) count[e] = 0u;
    barrier();
    for (uint p = t; p < pairs; p += WG) atomicAdd(count[id_of(p)], 1u);
    barrier();
    // Exclusive prefix sum: invocation t owns ids t * per .. t * per + per - 1.
    uint per = (pc.n_ids + WG - 1u) / WG, e0 = t * per, e1 = min(e0 + per, pc.n_ids);
    uint sum = 0u;
    for (uint e = e0; e < e1; e++) sum += count[e];
    uint before = subgroupExclusiveAdd(sum);
    if (gl_SubgroupInvocationID == gl_SubgroupSize - 1u) partial[gl_SubgroupID] = before + sum;
    barrier();
    for (uint i = 0u; i < gl_SubgroupID; i++) before += partial[i];
    for (uint e = e0; e < e1; e++) {
        uint c = count[e];
        count[e] = before;
        before += c;
    }
    barrier();
    if (pc.tiles_off != 0u) {
        // count[e] is id e's first place now; its pairs end where the next id's begin.
        uint tiles = 0u;
        for (uint e = e0; e < e1; e++) tiles += ((e + 1u < pc.n_ids ? count[e + 1u] : pairs) - count[e] + pc.tile - 1u) / pc.tile;
        uint at = subgroupExclusiveAdd(tiles);
        if (gl_SubgroupInvocationID == gl_SubgroupSize - 1u) tiles_partial[gl_SubgroupID] = at + tiles;
        barrier();
        for (uint i = 0u; i < gl_SubgroupID; i++) at += tiles_partial[i];
        for (uint e = e0; e < e1; e++) {
            uint first = count[e], c = (e + 1u < pc.n_ids ? count[e + 1u] : pairs) - first;
            for (uint i = 0u; i < c; i += pc.tile) {
                s[pc.tiles_off + 1u + 2u * at] = uintBitsToFloat(first + i);
                s[pc.tiles_off + 2u + 2u * at] = uintBitsToFloat(min(pc.tile, c - i));
                at++;
            }
        }
        // The last invocation's ids are the last ones: it ends at the total.
        if (t == WG - 1u) s[pc.tiles_off] = uintBitsToFloat(at);
        // Every first place is read before the pairs take them.
        barrier();
    }
    for (uint p = t; p < pairs; p += WG) {
        uint at = atomicAdd(count[id_of(p)], 1u);
        s[pc.order_off + (at / pc.k) * pc.tok_stride + at % pc.k] = uintBitsToFloat(p);
    }
}
