//! The attribute-macro front end of moeforge: `#[moe_layer(...)]` reads a layer in the
//! same language as `.moe` files, and at compile time parses, checks and plans it with the
//! compiler crate, generates its CUDA unit and, when NVRTC is available to the build,
//! compiles it to PTX. The annotated function becomes a function returning a
//! `&'static moeforge::embedded::SpecLayer<H, K>` that carries the plan, the source and the
//! PTX; see the facade's `moeforge::embedded` for what the handle does at run time and the
//! facade's documentation of `moe_layer` for the arguments.
//!
//! A mistake in the layer is a `compile_error!` carrying the message and hint `moeforge
//! check` gives (rendered by the same code), placed at the offending token when the
//! compiler can point inside a string literal (nightly), else at the literal or the `file`
//! argument with the spec's own `path:line:column` in the message. The original item is
//! emitted beside the errors so that IDEs keep working.

use std::path::PathBuf;

use moeforge_compiler::diagnostics::Diagnostics;
use moeforge_compiler::plan::{self, Plan, Target};
use moeforge_compiler::{codegen, compile_source_for, decode, ir, plan_diagnostics};
use moeforge_runtime::aot;
use moeforge_runtime::jit::{Jit, JitError};
use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Ident, ItemFn, LitStr, Token};

/// See the facade crate (`moeforge::moe_layer`) for the documentation.
#[proc_macro_attribute]
pub fn moe_layer(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = TokenStream2::from(item);
    match expand(attr.into(), item.clone()) {
        Ok(expansion) => expansion.into(),
        Err(errors) => {
            let errors = errors
                .iter()
                .map(|(span, message)| quote_spanned!(*span=> ::core::compile_error!(#message);));
            quote!(#(#errors)* #item).into()
        }
    }
}

/// Errors of one expansion: where each goes and its message.
type Errors = Vec<(Span, String)>;

fn error(span: Span, message: impl Into<String>) -> Errors {
    vec![(span, message.into())]
}

/// One argument of the attribute: the spec as a string literal, or `key = "value"`.
enum Arg {
    Spec(LitStr),
    Keyed(Ident, LitStr),
}

impl Parse for Arg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        if input.peek(LitStr) {
            return Ok(Arg::Spec(input.parse()?));
        }
        let key: Ident = input.parse()?;
        input.parse::<Token![=]>()?;
        Ok(Arg::Keyed(key, input.parse()?))
    }
}

/// The attribute's arguments, checked: exactly one of the inline spec and `file`.
struct Args {
    source: SpecSource,
    layer: Option<LitStr>,
    target: Option<LitStr>,
}

enum SpecSource {
    Inline(LitStr),
    File(LitStr),
}

const USAGE: &str = "moe_layer takes the layer spec as a string literal, or `file = \"path/relative/to/Cargo.toml.moe\"`, and optionally `layer = \"name\"` and `target = \"h200\"`";

fn parse_args(attr: TokenStream2) -> Result<Args, Errors> {
    let args = syn::parse::Parser::parse2(Punctuated::<Arg, Token![,]>::parse_terminated, attr)
        .map_err(|e| error(e.span(), format!("{e}; {USAGE}")))?;
    let mut source = None;
    let mut layer = None;
    let mut target = None;
    for arg in args {
        let (slot, span, value, what) = match arg {
            Arg::Spec(lit) => (&mut source, lit.span(), SpecSource::Inline(lit), "a spec"),
            Arg::Keyed(key, lit) => match key.to_string().as_str() {
                "file" => (&mut source, key.span(), SpecSource::File(lit), "a spec"),
                "layer" => {
                    set_once(&mut layer, lit, key.span(), "`layer`")?;
                    continue;
                }
                "target" => {
                    set_once(&mut target, lit, key.span(), "`target`")?;
                    continue;
                }
                other => {
                    return Err(error(
                        key.span(),
                        format!("unknown argument `{other}`; {USAGE}"),
                    ));
                }
            },
        };
        set_once(slot, value, span, what)?;
    }
    let Some(source) = source else {
        return Err(error(
            Span::call_site(),
            format!("no layer spec given; {USAGE}"),
        ));
    };
    Ok(Args {
        source,
        layer,
        target,
    })
}

fn set_once<T>(slot: &mut Option<T>, value: T, span: Span, what: &str) -> Result<(), Errors> {
    if slot.is_some() {
        return Err(error(
            span,
            format!("{what} is given twice (an inline spec and `file` count as one); {USAGE}"),
        ));
    }
    *slot = Some(value);
    Ok(())
}

/// The spec's text, as the compiler sees it, and how its byte offsets map back to Rust.
struct Spec {
    /// Shown in diagnostics: the `.moe` path as written, or the Rust file of the literal.
    file_name: String,
    /// The text compiled. For an inline spec whose literal is verbatim (no escapes) this
    /// is the literal's value preceded by as many line breaks and spaces as put it where
    /// it is in the Rust file, so that diagnostics give that file's lines and columns.
    text: String,
    /// Where errors go when they cannot point inside the literal.
    span: Span,
    /// For an inline, verbatim literal: the literal, and the offset in `text` at which
    /// the literal's token text starts (its `r#"` prefix included).
    literal: Option<(LitStr, usize)>,
    /// The absolute path of a spec file, tracked with `include_bytes!`.
    tracked: Option<PathBuf>,
}

fn read_spec(source: &SpecSource) -> Result<Spec, Errors> {
    match source {
        SpecSource::Inline(lit) => Ok(inline_spec(lit)),
        SpecSource::File(lit) => {
            let written = lit.value();
            let Some(dir) = std::env::var_os("CARGO_MANIFEST_DIR") else {
                return Err(error(
                    lit.span(),
                    "CARGO_MANIFEST_DIR is not set: `file = ...` is resolved relative to the crate's Cargo.toml, so build with cargo",
                ));
            };
            let path = PathBuf::from(dir).join(&written);
            let bytes = std::fs::read(&path).map_err(|e| {
                error(
                    lit.span(),
                    format!(
                        "cannot read the layer spec `{written}` ({}): {e}; the path is relative to the crate's Cargo.toml",
                        path.display()
                    ),
                )
            })?;
            let text = decode(&written, &bytes)
                .map_err(|diagnostics| render_each(&diagnostics, |_| lit.span()))?
                .to_string();
            Ok(Spec {
                file_name: written,
                text,
                span: lit.span(),
                literal: None,
                tracked: Some(path),
            })
        }
    }
}

fn inline_spec(lit: &LitStr) -> Spec {
    let value = lit.value();
    let token = lit.token().to_string();
    // The literal's prefix (`"`, `r"`, `r#"`, ...) and its content as written.
    let (prefix, content) = match token.strip_prefix('r') {
        Some(raw) => {
            let hashes = raw.len() - raw.trim_start_matches('#').len();
            let prefix = 1 + hashes + 1;
            (prefix, token.get(prefix..token.len() - 1 - hashes))
        }
        None => (1, token.get(1..token.len().saturating_sub(1))),
    };
    let start = lit.span().start();
    if content != Some(value.as_str()) || start.line == 0 {
        // Escapes make offsets in the value differ from offsets in the Rust file: the
        // diagnostics count lines and columns within the spec.
        return Spec {
            file_name: "<layer spec in #[moe_layer]>".to_string(),
            text: value,
            span: lit.span(),
            literal: None,
            tracked: None,
        };
    }
    let mut text = "\n".repeat(start.line - 1);
    text.push_str(&" ".repeat(start.column));
    let literal_start = text.len();
    text.push_str(&" ".repeat(prefix));
    text.push_str(&value);
    Spec {
        file_name: lit.span().file(),
        text,
        span: lit.span(),
        literal: Some((lit.clone(), literal_start)),
        tracked: None,
    }
}

impl Spec {
    /// The span for a byte offset of `text`: inside the literal where the compiler allows
    /// it (nightly), else the literal or the `file` argument.
    fn span_at(&self, offset: usize, len: usize) -> Span {
        self.literal
            .as_ref()
            .and_then(|(lit, start)| {
                let at = offset.checked_sub(*start)?;
                lit.token().subspan(at..at + len.max(1))
            })
            .unwrap_or(self.span)
    }

    fn errors(&self, diagnostics: &Diagnostics) -> Errors {
        render_each(diagnostics, |error| {
            let span = error.span();
            self.span_at(span.start, span.end.saturating_sub(span.start))
        })
    }
}

/// One compile error per diagnostic, each rendered exactly as `moeforge check` renders
/// it (file:line:column, the source line, a caret and the hint), less the leading
/// `error: ` that rustc adds itself.
fn render_each(
    diagnostics: &Diagnostics,
    span_of: impl Fn(&moeforge_compiler::Error) -> Span,
) -> Errors {
    diagnostics
        .errors
        .iter()
        .take(moeforge_compiler::diagnostics::MAX_RENDERED_ERRORS)
        .map(|error| {
            let single = Diagnostics {
                errors: vec![error.clone()],
                ..diagnostics.clone()
            };
            let rendered = single.render();
            let rendered = rendered.strip_prefix("error: ").unwrap_or(&rendered);
            (span_of(error), rendered.trim_end().to_string())
        })
        .collect()
}

/// Everything the expansion embeds about one planned layer.
struct Planned {
    plan: Plan,
    source: String,
    ptx: Option<String>,
}

fn plan_layer(spec: &Spec, args: &Args) -> Result<Planned, Errors> {
    let target = match &args.target {
        None => Target::h200(),
        Some(lit) => Target::named(&lit.value()).ok_or_else(|| {
            let known: Vec<&str> = Target::known().iter().map(|(name, _)| *name).collect();
            error(
                lit.span(),
                format!(
                    "unknown target `{}`; known targets: {}",
                    lit.value(),
                    known.join(", ")
                ),
            )
        })?,
    };
    let module =
        compile_source_for(&spec.file_name, &spec.text, &target).map_err(|d| spec.errors(&d))?;
    let layer = select_layer(&module, args.layer.as_ref(), spec)?;
    let plan = plan::plan(layer, &target).map_err(|e| {
        spec.errors(&plan_diagnostics(
            &spec.file_name,
            &spec.text,
            layer,
            &target,
            &e,
        ))
    })?;
    let source = codegen::generate(&plan).map_err(|e| {
        error(
            Span::call_site(),
            format!(
                "moeforge could not generate the kernels of `{}` (a moeforge bug): {e}",
                plan.layer
            ),
        )
    })?;
    // NVRTC at build time: embed the PTX so that the binary needs no NVRTC. Without a
    // toolkit the source is embedded and compiled at first use (the handle says so).
    let ptx = match Jit::from_env() {
        Ok(jit) => Some(
            jit.compile(&source.source, &aot::compile_options(&plan))
                .map_err(|e| {
                    error(
                        Span::call_site(),
                        format!(
                            "NVRTC could not compile the kernels of `{}` (a moeforge bug): {e}",
                            plan.layer
                        ),
                    )
                })?
                .ptx,
        ),
        // No toolkit here: the source is embedded.
        Err(JitError::Toolkit(_)) => None,
        // A setting the user got wrong: say so rather than embed the source silently.
        Err(e) => {
            return Err(error(
                Span::call_site(),
                format!(
                    "moeforge cannot compile the kernels of `{}` here: {e}",
                    plan.layer
                ),
            ));
        }
    };
    Ok(Planned {
        plan,
        source: source.source,
        ptx,
    })
}

fn select_layer<'m>(
    module: &'m ir::Module,
    wanted: Option<&LitStr>,
    spec: &Spec,
) -> Result<&'m ir::Layer, Errors> {
    let names: Vec<&str> = module.layers.iter().map(|l| l.name.as_str()).collect();
    match wanted {
        Some(lit) => {
            let name = lit.value();
            module
                .layers
                .iter()
                .find(|l| l.name == name)
                .ok_or_else(|| {
                    error(
                        lit.span(),
                        format!(
                            "{} has no layer `{name}` (it has: {})",
                            spec.file_name,
                            names.join(", ")
                        ),
                    )
                })
        }
        None => match module.layers.as_slice() {
            [layer] => Ok(layer),
            [] => Err(error(
                spec.span,
                format!("{} defines no layer", spec.file_name),
            )),
            _ => Err(error(
                spec.span,
                format!(
                    "{} has {} layers; pick one with `layer = \"name\"` ({})",
                    spec.file_name,
                    names.len(),
                    names.join(", ")
                ),
            )),
        },
    }
}

/// The annotated item: a function with no parameters, no return type and an empty body,
/// whose body and signature the macro writes.
fn check_item(item: TokenStream2) -> Result<ItemFn, Errors> {
    let function: ItemFn = syn::parse2(item).map_err(|e| {
        error(
            e.span(),
            "#[moe_layer] goes on a function: `fn name() {}`, which becomes a function returning the layer",
        )
    })?;
    let sig = &function.sig;
    let mut errors = Errors::new();
    if !sig.inputs.is_empty() || !sig.generics.params.is_empty() {
        errors.push((
            sig.paren_token.span.join(),
            "a #[moe_layer] function takes no parameters and no generics: it returns the layer's handle".to_string(),
        ));
    }
    if let syn::ReturnType::Type(arrow, _) = &sig.output {
        errors.push((
            arrow.spans[0],
            "a #[moe_layer] function has no return type: the macro gives it one (`&'static moeforge::embedded::SpecLayer<H, K>`)".to_string(),
        ));
    }
    if sig.asyncness.is_some() || sig.constness.is_some() || sig.unsafety.is_some() {
        errors.push((
            sig.fn_token.span,
            "a #[moe_layer] function is a plain `fn` (not async, const or unsafe)".to_string(),
        ));
    }
    if !function.block.stmts.is_empty() {
        errors.push((
            function.block.brace_token.span.join(),
            "a #[moe_layer] function has an empty body `{}`: the macro writes the body".to_string(),
        ));
    }
    if errors.is_empty() {
        Ok(function)
    } else {
        Err(errors)
    }
}

fn expand(attr: TokenStream2, item: TokenStream2) -> Result<TokenStream2, Errors> {
    let function = check_item(item)?;
    let args = parse_args(attr)?;
    let spec = read_spec(&args.source)?;
    let Planned { plan, source, ptx } = plan_layer(&spec, &args)?;
    let plan_json = serde_json::to_string(&plan).map_err(|e| {
        error(
            Span::call_site(),
            format!("cannot serialise the plan of `{}`: {e}", plan.layer),
        )
    })?;

    let shape = &plan.shape;
    let (hidden, ffn, experts, top_k, max_tokens, w1_rows) = (
        shape.hidden,
        shape.ffn,
        shape.experts,
        shape.top_k,
        shape.max_tokens,
        shape.w1_rows(),
    );
    let shared_slices = shape.shared_slices;
    let (h, k) = (hidden as usize, top_k as usize);
    let layer_name = &plan.layer;
    let target_name = &plan.target.name;
    let spec_name = &spec.file_name;
    let kernels = if ptx.is_some() {
        "PTX embedded at build time (no NVRTC needed to load it)"
    } else {
        "CUDA source embedded; NVRTC compiles it at first use (it was not available at build time)"
    };
    let summary = format!(
        " moeforge layer `{layer_name}` from {spec_name}: hidden = {hidden}, ffn = {ffn}, experts = {experts}, top_k = {top_k}, max_tokens = {max_tokens}; planned for the {target_name}; {kernels}."
    );
    let ptx = match &ptx {
        Some(ptx) => quote!(::core::option::Option::Some(#ptx)),
        None => quote!(::core::option::Option::None),
    };
    // Cargo rebuilds the crate when the spec file changes: it is read by the expansion.
    let tracked = spec.tracked.as_ref().map(|path| {
        let path = path.to_string_lossy();
        quote!(
            const _: &[u8] = ::core::include_bytes!(#path);
        )
    });

    // Whether the PTX is embedded depends on finding NVRTC, through these variables (and
    // the `.venv` of the workspace): reading them with `option_env!` makes cargo expand the
    // macro again when they change, so a build without NVRTC is not kept once it is found.
    let toolkit_vars = quote! {
        const _: [::core::option::Option<&str>; 4] = [
            ::core::option_env!("CUDA_HOME"),
            ::core::option_env!("CUDA_PATH"),
            ::core::option_env!("MOEFORGE_NVRTC_WHEEL"),
            ::core::option_env!("VIRTUAL_ENV"),
        ];
    };

    let ItemFn {
        attrs, vis, sig, ..
    } = function;
    let name = &sig.ident;
    let handle = quote!(::moeforge::embedded::SpecLayer<#h, #k>);
    Ok(quote! {
        #(#attrs)*
        #[doc = ""]
        #[doc = #summary]
        #vis fn #name() -> &'static #handle {
            #tracked
            #toolkit_vars
            static LAYER: #handle = ::moeforge::embedded::SpecLayer::new(
                ::moeforge::embedded::Artifacts {
                    layer: #layer_name,
                    spec: #spec_name,
                    target: #target_name,
                    shape: ::moeforge::embedded::Shape {
                        hidden: #hidden,
                        ffn: #ffn,
                        experts: #experts,
                        top_k: #top_k,
                        max_tokens: #max_tokens,
                        shared_slices: #shared_slices,
                        w1_rows: #w1_rows,
                    },
                    plan_json: #plan_json,
                    source: #source,
                    ptx: #ptx,
                },
            );
            &LAYER
        }
    })
}
