//! One request's tokens and text, whichever API it came in on: [`tokenizer`] turns text
//! into ids and [`chat`] renders chat templates, [`generation`] runs an admitted request
//! on a replica (failing over when one dies) and [`text`] turns ids back into text,
//! applying stop strings. What a request passes before it gets here — admission, tenant
//! limits, the response cache, the fair gate — is the process's
//! [`crate::frontend::FrontEnd`].

pub mod chat;
pub mod generation;
pub mod metrics;
pub mod reply;
pub mod span;
pub mod text;
pub mod tokenizer;
pub mod tools;
