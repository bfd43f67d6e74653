//! What every SVG picture seqpipe draws starts with.

use std::fmt::Write as _;

/// Writes the `<svg>` element (monospace text) and a white background of `width` × `height`.
pub fn open(out: &mut String, width: f64, height: f64) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="monospace">"#
    );
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="white"/>"#
    );
}
