//! `H2DMirror`: exact matches, binding to one destination, and the stager's key.

use pinstage::testing::CopyKey;
use pinstage::{Error, H2DMirror};

#[test]
fn exact_match_and_binding() {
    let mut m = H2DMirror::new();
    assert!(!m.matches(b"k", &[1, 2]));
    m.record(b"k", &[1, 2]);
    assert!(m.matches(b"k", &[1, 2]));
    assert!(!m.matches(b"k", &[1, 3]));
    assert!(!m.matches(b"k", &[1, 2, 0]));
    assert!(!m.matches(b"j", &[1, 2]));
    m.bind(0x10, 8).unwrap();
    m.bind(0x10, 8).unwrap();
    assert!(matches!(
        m.bind(0x20, 8),
        Err(Error::MirrorReused { bound: 0x10 })
    ));
    m.invalidate();
    assert!(!m.matches(b"k", &[1, 2]));
    m.bind(0x20, 8).unwrap();
}

#[test]
fn key_distinguishes_pad() {
    let a = CopyKey::new(1, 16, None);
    let b = CopyKey::new(1, 16, Some(&[0, 0, 0, 0]));
    let c = CopyKey::new(1, 16, Some(&[1, 0, 0, 0]));
    assert_ne!(a.as_bytes(), b.as_bytes());
    assert_ne!(b.as_bytes(), c.as_bytes());
}

#[test]
fn validity_follows_record_and_invalidate() {
    let mut m = H2DMirror::new();
    assert!(!m.is_valid());
    m.record(b"k", &[1]);
    assert!(m.is_valid());
    m.invalidate();
    assert!(!m.is_valid());
}
