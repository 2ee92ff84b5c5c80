// NeoX rotary embedding of a vector held in `vec_sh` (one element per
// invocation), with the host's cos/sin table for the position at
// s[table .. table + 2*half]. Returns element i rotated.
float rope_at(uint i, uint table, uint half_dims) {
    if (i >= 2u * half_dims) return vec_sh[i];
    uint p = i < half_dims ? i : i - half_dims;
    float c = s[table + p], sn = s[table + half_dims + p];
    float a = vec_sh[p], b = vec_sh[p + half_dims];
    return i < half_dims ? a * c - b * sn : b * c + a * sn;
}
