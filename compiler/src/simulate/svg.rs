//! A timeline of one call as an SVG picture, written by hand: per recorded rank a lane of
//! communication work items and a lane of compute (kernels as outlines, the first GEMM
//! block's tiles as bars, so the gaps where it waits for chunks show).

use std::fmt::Write as _;

use super::{RankTimeline, ScheduleReport};

/// Width of the time axis, pixels.
const WIDTH: f64 = 1200.0;
/// Left margin for the lane labels, pixels.
const LEFT: f64 = 170.0;
/// Height of one lane and the gap under it, pixels.
const LANE: f64 = 16.0;
const GAP: f64 = 6.0;

/// The SVG of `schedule`'s recorded ranks, titled `title`.
pub fn timeline_svg(title: &str, schedule: &ScheduleReport) -> String {
    let end = schedule.layer_s.max(1e-9);
    let x = |t: f64| LEFT + t / end * WIDTH;
    let lanes = schedule.timeline.len() as f64 * 2.0;
    let height = 60.0 + lanes * (LANE + GAP);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="monospace" font-size="11">"#,
        LEFT + WIDTH + 20.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="4" y="16">{} — {} — layer {:.1} us, dispatch {:.1} us, combine {:.1} us</text>"#,
        escape(title),
        schedule.schedule.name(),
        schedule.layer_s * 1e6,
        schedule.dispatch_s * 1e6,
        schedule.combine_s * 1e6
    );
    let mut y = 30.0;
    for (rank, lane) in schedule.timeline.iter().enumerate() {
        draw_comm(&mut svg, rank, lane, y, &x);
        y += LANE + GAP;
        draw_compute(&mut svg, rank, lane, y, &x);
        y += LANE + GAP;
    }
    let _ = writeln!(
        svg,
        r#"<line x1="{LEFT}" y1="{y}" x2="{}" y2="{y}" stroke="black"/><text x="{LEFT}" y="{}">0</text><text x="{}" y="{}" text-anchor="end">{:.1} us</text>"#,
        LEFT + WIDTH,
        y + 14.0,
        LEFT + WIDTH,
        y + 14.0,
        end * 1e6
    );
    svg.push_str("</svg>\n");
    svg
}

fn draw_comm(svg: &mut String, rank: usize, lane: &RankTimeline, y: f64, x: &dyn Fn(f64) -> f64) {
    let _ = writeln!(
        svg,
        r#"<text x="4" y="{}">rank {rank} comm</text>"#,
        y + 12.0
    );
    for span in &lane.comm {
        let _ = writeln!(
            svg,
            r##"<rect x="{:.2}" y="{y}" width="{:.2}" height="{LANE}" fill="#3b7dd8" fill-opacity="0.25"><title>{} {:.2}-{:.2} us</title></rect>"##,
            x(span.start),
            (x(span.end) - x(span.start)).max(0.5),
            escape(&span.label),
            span.start * 1e6,
            span.end * 1e6
        );
    }
}

fn draw_compute(
    svg: &mut String,
    rank: usize,
    lane: &RankTimeline,
    y: f64,
    x: &dyn Fn(f64) -> f64,
) {
    let _ = writeln!(
        svg,
        r#"<text x="4" y="{}">rank {rank} compute</text>"#,
        y + 12.0
    );
    for span in &lane.kernels {
        let _ = writeln!(
            svg,
            r##"<rect x="{:.2}" y="{y}" width="{:.2}" height="{LANE}" fill="none" stroke="#444"><title>{} {:.2}-{:.2} us</title></rect>"##,
            x(span.start),
            (x(span.end) - x(span.start)).max(0.5),
            escape(&span.label),
            span.start * 1e6,
            span.end * 1e6
        );
    }
    for span in &lane.tiles {
        let color = if span.label == "GEMM1" {
            "#d8843b"
        } else {
            "#3bd87d"
        };
        let _ = writeln!(
            svg,
            r#"<rect x="{:.2}" y="{}" width="{:.2}" height="{}" fill="{color}"/>"#,
            x(span.start),
            y + 3.0,
            (x(span.end) - x(span.start)).max(0.3),
            LANE - 6.0
        );
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
