//! Every `#[repr(C)]` push-constant mirror in [`super::pipelines`] is held
//! against the shader it feeds, from both ends:
//!
//! * the compiled SPIR-V, by just enough reflection to read its
//!   push-constant block (byte offsets and scalar kinds; member names too
//!   when the module keeps them, which `glslc -O` does not): checked when
//!   every pipeline is created, so a module built from other sources than
//!   this build's mirrors is refused with the difference;
//! * the GLSL source, whose block's member names and kinds the test below
//!   parses, so two fields of one kind swapped on one side fail too.

/// A push-constant member's scalar kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scalar {
    U32,
    F32,
}

/// One member of a push-constant block: (name when the module keeps it, byte offset, kind).
pub(crate) type Member = (Option<String>, usize, Scalar);

const OP_MEMBER_NAME: u32 = 6;
const OP_TYPE_INT: u32 = 21;
const OP_TYPE_FLOAT: u32 = 22;
const OP_TYPE_STRUCT: u32 = 30;
const OP_TYPE_POINTER: u32 = 32;
const OP_VARIABLE: u32 = 59;
const OP_MEMBER_DECORATE: u32 = 72;
const DECORATION_OFFSET: u32 = 35;
const STORAGE_PUSH_CONSTANT: u32 = 9;

/// Whether a reflected block is the mirror's fields (names where it has them).
pub(crate) fn same(shader: &[Member], mirror: &[(&str, usize, Scalar)]) -> bool {
    shader.len() == mirror.len()
        && shader.iter().zip(mirror).all(|(a, b)| a.0.as_deref().is_none_or(|n| n == b.0) && a.1 == b.1 && a.2 == b.2)
}

/// A literal string operand (UTF-8, NUL-terminated, padded to words).
fn string(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The members of the module's push-constant block, in order; `Err` says
/// what is missing (no block, a member that is not a 32-bit scalar).
pub(crate) fn push_constants(spirv: &[u8]) -> Result<Vec<Member>, String> {
    if spirv.len() < 20 || !spirv.len().is_multiple_of(4) {
        return Err("not a SPIR-V module".into());
    }
    let words: Vec<u32> = spirv.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    if words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module (magic)".into());
    }
    let mut insts = Vec::new();
    let mut at = 5;
    while at < words.len() {
        let (count, op) = ((words[at] >> 16) as usize, words[at] & 0xffff);
        if count == 0 || at + count > words.len() {
            return Err("truncated instruction".into());
        }
        insts.push((op, &words[at + 1..at + count]));
        at += count;
    }
    let find = |op: u32, id: u32| insts.iter().find(|(o, a)| *o == op && a.first() == Some(&id)).map(|(_, a)| *a);
    let pointer = insts
        .iter()
        .find(|(o, a)| *o == OP_VARIABLE && a.get(2) == Some(&STORAGE_PUSH_CONSTANT))
        .map(|(_, a)| a[0])
        .ok_or("no push-constant block")?;
    let block = find(OP_TYPE_POINTER, pointer).ok_or("push-constant pointer type missing")?[2];
    let members = &find(OP_TYPE_STRUCT, block).ok_or("push-constant block is not a struct")?[1..];
    let mut out = Vec::with_capacity(members.len());
    for (i, &ty) in members.iter().enumerate() {
        let i = i as u32;
        let name = insts
            .iter()
            .find(|(o, a)| *o == OP_MEMBER_NAME && a[0] == block && a[1] == i)
            .map(|(_, a)| string(&a[2..]));
        let offset = insts
            .iter()
            .find(|(o, a)| *o == OP_MEMBER_DECORATE && a[0] == block && a[1] == i && a[2] == DECORATION_OFFSET)
            .map(|(_, a)| a[3] as usize)
            .ok_or_else(|| format!("member {i} has no offset"))?;
        let scalar = match (find(OP_TYPE_INT, ty), find(OP_TYPE_FLOAT, ty)) {
            (Some(t), _) if t[1] == 32 && t[2] == 0 => Scalar::U32,
            (_, Some(t)) if t[1] == 32 => Scalar::F32,
            _ => return Err(format!("member {i} is not a 32-bit uint or float")),
        };
        out.push((name, offset, scalar));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::pipelines::TABLE;
    use super::*;

    /// The `layout(push_constant)` block of a GLSL source: (name, kind) per member.
    fn source_block(src: &str) -> Vec<(String, Scalar)> {
        let start = src.find("layout(push_constant)").expect("a push-constant block");
        let body = &src[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
        let mut out = Vec::new();
        for line in body.lines() {
            let decl = line.split("//").next().unwrap().trim();
            let Some(decl) = decl.strip_suffix(';') else { continue };
            let (ty, names) = decl.split_once(' ').expect("a declaration");
            let kind = match ty {
                "uint" => Scalar::U32,
                "float" => Scalar::F32,
                other => panic!("push-constant member of type {other}"),
            };
            out.extend(names.split(',').map(|n| (n.trim().to_string(), kind)));
        }
        out
    }

    /// The source of pipeline `name`'s push-constant block (the matvec
    /// variants, the matrix-matrix modules and the split rows' sums share
    /// shaders/matvec_push.glsl; a `_batch` module is its plain module's
    /// source with `BATCH`).
    fn source_of(name: &str) -> String {
        let file = if ["matvec_", "expert_", "mm_", "split_sums"].iter().any(|p| name.starts_with(p)) {
            "matvec_push.glsl".into()
        } else if name == "gdn_token" {
            // gdn_recurrent.comp's second block (TOKEN's): the first cut off.
            let src = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/gdn_recurrent.comp")).unwrap();
            let second = src.match_indices("layout(push_constant)").nth(1).expect("TOKEN's push-constant block").0;
            return src[second..].to_string();
        } else {
            format!("{}.comp", name.strip_suffix("_batch").unwrap_or(name))
        };
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders").join(file);
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn every_push_block_matches_its_shader() {
        for spec in TABLE {
            let shader = push_constants(spec.spirv).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            assert!(same(&shader, spec.fields), "{}: SPIR-V block {shader:?}, Rust mirror {:?}", spec.name, spec.fields);
            let end = shader.last().map_or(0, |m| m.1 + 4);
            assert_eq!(end, spec.push_size, "{}: push-constant block size", spec.name);
            let mirror: Vec<(String, Scalar)> = spec.fields.iter().map(|&(n, _, k)| (n.to_string(), k)).collect();
            assert_eq!(source_block(&source_of(spec.name)), mirror, "{}: GLSL block (left), Rust mirror (right)", spec.name);
        }
    }

    #[test]
    fn reads_a_known_block() {
        // shaders/hc_norm.comp: uint x_off, gamma, y_off, n; float eps; uint tok_stride, q_off.
        let spec = TABLE.iter().find(|s| s.name == "hc_norm").unwrap();
        let kinds = [Scalar::U32, Scalar::U32, Scalar::U32, Scalar::U32, Scalar::F32, Scalar::U32, Scalar::U32];
        let got: Vec<(usize, Scalar)> = push_constants(spec.spirv).unwrap().into_iter().map(|m| (m.1, m.2)).collect();
        assert_eq!(got, kinds.iter().enumerate().map(|(i, k)| (4 * i, *k)).collect::<Vec<_>>());
        let names = ["x_off", "gamma", "y_off", "n", "eps", "tok_stride", "q_off"];
        assert_eq!(source_block(&source_of("hc_norm")), names.iter().zip(kinds).map(|(n, k)| (n.to_string(), k)).collect::<Vec<_>>());
        assert!(push_constants(&spec.spirv[..12]).is_err());
        // A mirror with two fields swapped, or one fewer, is not the block.
        let mut swapped = spec.fields.to_vec();
        swapped.swap(1, 2);
        let renamed: Vec<Member> = push_constants(spec.spirv).unwrap().into_iter().zip(names).map(|(m, n)| (Some(n.to_string()), m.1, m.2)).collect();
        assert!(same(&renamed, spec.fields));
        assert!(!same(&renamed, &swapped));
        assert!(!same(&renamed, &spec.fields[..6]));
    }
}
