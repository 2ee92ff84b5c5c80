use std::any::{Any, TypeId};
use std::borrow::Cow;
use std::collections::BTreeMap;
#[cfg(feature = "multi_template")]
use std::collections::BTreeSet;
use std::fmt;

use crate::compiler::instructions::Instructions;
use crate::environment::Environment;
use crate::error::{Error, ErrorKind};
use crate::output::Output;
use crate::template::Template;
use crate::utils::{AutoEscape, UndefinedBehavior};
use crate::value::{ArgType, Value};
use crate::vm::context::Context;

#[cfg(feature = "fuel")]
use crate::vm::fuel::FuelTracker;

/// When macros are used, the state carries an `id` counter. Whenever a state is
/// created, the counter is incremented. Macro values use this ID to ensure that
/// their render-local closures and instruction streams are only accessed through
/// the state that owns them.
#[cfg(feature = "macros")]
static STATE_ID: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

/// Provides access to the current execution state of the engine.
///
/// The state is passed to filters, tests, functions, and callable objects to
/// let them interface with the engine.  Typed callbacks can request either a
/// shared or mutable reference.  Shared access is useful for inspecting the
/// template environment, context variables, and current auto-escaping behavior;
/// mutable access additionally permits nested calls and render-local storage.
///
/// In some testing scenarios or more advanced use cases you might need to get
/// a [`State`].  The state is managed as part of the template execution but the
/// initial state can be retrieved via [`Template::new_state`](crate::Template::new_state).
/// The most common way to get hold of the state however is via functions of filters.
///
/// **Notes on lifetimes:** the state object exposes some of the internal
/// lifetimes through the type.  You should always elide these lifetimes
/// as there might be lifetimes added or removed between releases.
pub struct State<'template, 'env> {
    pub(crate) ctx: Context<'env>,
    #[cfg(feature = "multi_template")]
    pub(crate) current_block: Option<&'env str>,
    pub(crate) auto_escape: AutoEscape,
    pub(crate) instructions: &'template Instructions<'env>,
    pub(crate) temps: BTreeMap<Box<str>, Value>,
    pub(crate) extensions: BTreeMap<TypeId, Box<dyn Any + Send>>,
    #[cfg(feature = "multi_template")]
    pub(crate) blocks: BTreeMap<&'env str, BlockStack<'template, 'env>>,
    #[cfg(feature = "multi_template")]
    pub(crate) loaded_templates: BTreeSet<&'env str>,
    #[cfg(feature = "macros")]
    pub(crate) id: isize,
    // Macro and loop values are 'static and cannot borrow their instruction
    // stream. Keep one stable render-local mapping per instruction stream
    // instead of adding an entry every time a lexical macro declaration or
    // recursive loop executes.
    #[cfg(any(feature = "macros", feature = "multi_template"))]
    pub(crate) known_instructions: BTreeMap<usize, &'template Instructions<'env>>,
    // Closures are region allocated for the lifetime of the state. Macro values
    // can escape an invocation through namespaces, temps, or extensions, so
    // these entries must not be truncated or reused while the state is alive.
    #[cfg(feature = "macros")]
    pub(crate) closures: Vec<crate::vm::Closure<'env>>,
    #[cfg(feature = "macros")]
    pub(crate) macro_context_pool: Vec<Context<'env>>,
    #[cfg(feature = "fuel")]
    pub(crate) fuel_tracker: Option<std::rc::Rc<FuelTracker>>,
    // Instruction streams that undefined values created during this render
    // point into.  Undefined values only carry an instruction id and a pc,
    // this is used to resolve them back into debug info when an error is
    // reported.  Only populated in debug mode.
    #[cfg(feature = "debug")]
    pub(crate) undefined_origins: BTreeMap<u32, &'template Instructions<'env>>,
}

impl fmt::Debug for State<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ds = f.debug_struct("State");
        ds.field("name", &self.instructions.name());
        #[cfg(feature = "multi_template")]
        ds.field("current_block", &self.current_block);
        ds.field("auto_escape", &self.auto_escape);
        ds.field(
            "ctx",
            &self.ctx.debug(
                #[cfg(feature = "macros")]
                &self.closures,
            ),
        );
        ds.field("env", &self.env());
        ds.finish()
    }
}

impl<'template, 'env> State<'template, 'env> {
    /// Creates a new state.
    pub(crate) fn new(
        ctx: Context<'env>,
        auto_escape: AutoEscape,
        instructions: &'template Instructions<'env>,
        #[cfg(feature = "multi_template")] blocks: BTreeMap<&'env str, BlockStack<'template, 'env>>,
    ) -> State<'template, 'env> {
        State {
            #[cfg(feature = "macros")]
            id: STATE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            #[cfg(feature = "multi_template")]
            current_block: None,
            auto_escape,
            instructions,
            #[cfg(feature = "multi_template")]
            blocks,
            temps: Default::default(),
            extensions: Default::default(),
            #[cfg(feature = "multi_template")]
            loaded_templates: BTreeSet::new(),
            #[cfg(any(feature = "macros", feature = "multi_template"))]
            known_instructions: Default::default(),
            #[cfg(feature = "macros")]
            closures: Default::default(),
            #[cfg(feature = "macros")]
            macro_context_pool: Default::default(),
            #[cfg(feature = "fuel")]
            fuel_tracker: ctx.env().fuel().map(|fuel| std::rc::Rc::new(FuelTracker::new(fuel))),
            #[cfg(feature = "debug")]
            undefined_origins: Default::default(),
            ctx,
        }
    }

    /// Creates an empty state for an environment.
    pub(crate) fn new_for_env(env: &'env Environment) -> State<'env, 'env> {
        State::new(
            Context::new(env),
            AutoEscape::None,
            &crate::compiler::instructions::EMPTY_INSTRUCTIONS,
            #[cfg(feature = "multi_template")]
            BTreeMap::new(),
        )
    }

    /// Returns a reference to the current environment.
    #[inline(always)]
    pub fn env(&self) -> &'env Environment<'env> {
        self.ctx.env()
    }

    /// Returns the name of the current template.
    pub fn name(&self) -> &str {
        self.instructions.name()
    }

    /// Returns the current value of the auto escape flag.
    #[inline(always)]
    pub fn auto_escape(&self) -> &AutoEscape {
        &self.auto_escape
    }

    #[cfg(any(feature = "macros", feature = "multi_template"))]
    pub(crate) fn with_execution_state<R>(
        &mut self,
        instructions: &'template Instructions<'env>,
        auto_escape: AutoEscape,
        #[cfg(feature = "multi_template")] current_block: Option<&'env str>,
        #[cfg(feature = "multi_template")] block_state: BlockState<'template, 'env>,
        f: impl FnOnce(&mut State<'template, 'env>) -> R,
    ) -> R {
        #[cfg(feature = "multi_template")]
        let stack_depth = match block_state {
            #[cfg(feature = "macros")]
            BlockState::Isolate => None,
            _ => Some(self.ctx.stack_depth()),
        };
        let old_instructions = std::mem::replace(&mut self.instructions, instructions);
        let old_auto_escape = std::mem::replace(&mut self.auto_escape, auto_escape);
        #[cfg(feature = "multi_template")]
        let old_current_block = std::mem::replace(&mut self.current_block, current_block);
        #[cfg(feature = "multi_template")]
        let old_block_state = match block_state {
            BlockState::Keep => None,
            #[cfg(feature = "macros")]
            BlockState::Isolate => Some(SavedBlockState::Isolated(
                self.blocks
                    .iter()
                    .map(|(name, block)| BlockCheckpoint {
                        name,
                        instruction_count: block.instructions.len(),
                        depth: block.depth,
                    })
                    .collect(),
                self.loaded_templates.clone(),
            )),
            BlockState::Replace(blocks) => Some(SavedBlockState::Replaced(
                std::mem::replace(&mut self.blocks, blocks),
                self.loaded_templates.clone(),
            )),
        };

        let rv = f(self);

        #[cfg(feature = "multi_template")]
        if let Some(stack_depth) = stack_depth {
            self.ctx.restore_stack_depth(stack_depth);
        }
        self.instructions = old_instructions;
        self.auto_escape = old_auto_escape;
        #[cfg(feature = "multi_template")]
        {
            self.current_block = old_current_block;
            match old_block_state {
                #[cfg(feature = "macros")]
                Some(SavedBlockState::Isolated(checkpoint, loaded_templates)) => {
                    self.blocks.retain(|name, _| {
                        checkpoint
                            .binary_search_by_key(name, |entry| entry.name)
                            .is_ok()
                    });
                    for entry in checkpoint {
                        let block = self.blocks.get_mut(entry.name).unwrap();
                        block.instructions.truncate(entry.instruction_count);
                        block.depth = entry.depth;
                    }
                    self.loaded_templates = loaded_templates;
                }
                Some(SavedBlockState::Replaced(blocks, loaded_templates)) => {
                    self.blocks = blocks;
                    self.loaded_templates = loaded_templates;
                }
                None => {}
            }
        }
        rv
    }

    pub(crate) fn with_auto_escape<R>(
        &mut self,
        auto_escape: AutoEscape,
        f: impl FnOnce(&mut State<'template, 'env>) -> R,
    ) -> R {
        if self.auto_escape == auto_escape {
            return f(self);
        }

        let old = std::mem::replace(&mut self.auto_escape, auto_escape);
        let rv = f(self);
        self.auto_escape = old;
        rv
    }

    /// Returns the current undefined behavior.
    #[inline(always)]
    pub fn undefined_behavior(&self) -> UndefinedBehavior {
        self.env().undefined_behavior()
    }

    /// Returns the name of the innermost block.
    #[cfg(feature = "multi_template")]
    #[cfg_attr(docsrs, doc(cfg(feature = "multi_template")))]
    #[inline(always)]
    pub fn current_block(&self) -> Option<&str> {
        self.current_block
    }

    /// Looks up a variable by name in the context.
    ///
    /// # Note on Closures
    ///
    /// Macros and call blocks analyze which variables are referenced and
    /// create closures for them.  This means that unless a variable is defined
    /// as a [global](Environment::add_global) in the environment, was passed in the
    /// initial render context, or was referenced by a macro, this method won't be
    /// able to find it.
    #[inline(always)]
    pub fn lookup(&self, name: &str) -> Option<Value> {
        self.ctx.load(
            #[cfg(feature = "macros")]
            &self.closures,
            name,
        )
    }

    /// Looks up a global macro and calls it.
    ///
    /// This looks up a value as [`lookup`](Self::lookup) does and calls it
    /// with the passed args.
    #[cfg(feature = "macros")]
    #[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
    pub fn call_macro(&mut self, name: &str, args: &[Value]) -> Result<String, Error> {
        let f = ok!(self.lookup(name).ok_or_else(|| Error::new(
            crate::error::ErrorKind::UnknownFunction,
            "macro not found"
        )));
        f.call(self, args).map(Into::into)
    }

    /// Renders a block with the given name into a string.
    ///
    /// This method works like [`Template::render`](crate::Template::render) but
    /// it only renders a specific block in the template.  The first argument is
    /// the name of the block.
    ///
    /// This renders only the block `hi` in the template:
    ///
    /// ```
    /// # use minijinja::{Environment, context};
    /// # fn test() -> Result<(), minijinja::Error> {
    /// # let mut env = Environment::new();
    /// # env.add_template("hello", "{% block hi %}Hello {{ name }}!{% endblock %}")?;
    /// let tmpl = env.get_template("hello")?;
    /// let mut rendered = tmpl
    ///     .render_captured(context!(name => "John"))?;
    /// let rv = rendered.with_state_mut(|state| state.render_block("hi"))?;
    /// println!("{}", rv);
    /// # Ok(()) }
    /// ```
    ///
    /// Rendering a block is a stateful operation and therefore requires mutable
    /// access to the state.  Filters and functions can request this by taking
    /// `&mut State` as their first parameter.  Execution frames are restored if
    /// rendering fails, while explicit mutations to temps or extensions remain.
    #[cfg(feature = "multi_template")]
    #[cfg_attr(docsrs, doc(cfg(feature = "multi_template")))]
    pub fn render_block(&mut self, block: &str) -> Result<String, Error> {
        let mut buf = String::new();
        crate::vm::call_block(block, self, &mut Output::new(&mut buf)).map(|_| buf)
    }

    /// Renders a block with the given name into an [`io::Write`](std::io::Write).
    ///
    /// For details see [`render_block`](Self::render_block).
    #[cfg(feature = "multi_template")]
    #[cfg_attr(docsrs, doc(cfg(feature = "multi_template")))]
    pub fn render_block_to_write<W>(&mut self, block: &str, w: W) -> Result<(), Error>
    where
        W: std::io::Write,
    {
        let mut wrapper = crate::output::WriteWrapper { w, err: None };
        crate::vm::call_block(block, self, &mut Output::new(&mut wrapper))
            .map(|_| ())
            .map_err(|err| wrapper.take_err(err))
    }

    /// Returns a list of the names of all exports (top-level variables).
    ///
    /// Like in Jinja2, names starting with an underscore are private and
    /// are not considered exports.  They can still be retrieved with
    /// [`lookup`](Self::lookup).
    pub fn exports(&self) -> Vec<&str> {
        self.ctx
            .exports()
            .keys()
            .copied()
            .filter(|name| !name.starts_with('_'))
            .collect()
    }

    /// Returns a list of all known variables.
    ///
    /// This list contains all variables that are currently known to the state.
    /// To retrieve the values you can use [`lookup`](Self::lookup).  This will
    /// include all the globals of the environment.  Note that if the context
    /// has been initialized with an object that lies about variables (eg: it
    /// does not correctly implement enumeration), the returned list might not
    /// be complete.
    pub fn known_variables(&self) -> Vec<Cow<'_, str>> {
        Vec::from_iter(self.ctx.known_variables(
            #[cfg(feature = "macros")]
            &self.closures,
            true,
        ))
    }

    /// Fetches a template by name with path joining.
    ///
    /// This works like [`Environment::get_template`] with the difference that the lookup
    /// undergoes path joining.  If the environment has a configured path joining callback,
    /// it will be invoked with the name of the current template as parent template.
    ///
    /// For more information see [`Environment::set_path_join_callback`].
    pub fn get_template(&self, name: &str) -> Result<Template<'env, 'env>, Error> {
        self.env()
            .get_template(&self.env().join_template_path(name, self.name()))
    }

    /// Invokes a filter with some arguments.
    ///
    /// ```
    /// # use minijinja::Environment;
    /// # let mut env = Environment::new();
    /// # env.add_filter("upper", |x: &str| x.to_uppercase());
    /// # let tmpl = env.template_from_str("").unwrap();
    /// # let mut state = tmpl.new_state();
    /// let rv = state.apply_filter("upper", &["hello world".into()]).unwrap();
    /// assert_eq!(rv.as_str(), Some("HELLO WORLD"));
    /// ```
    pub fn apply_filter(&mut self, filter: &str, args: &[Value]) -> Result<Value, Error> {
        match self.env().get_filter(filter) {
            Some(filter) => filter.call(self, args),
            None => Err(Error::from(ErrorKind::UnknownFilter)),
        }
    }

    /// Invokes a test function on a value.
    ///
    /// ```
    /// # use minijinja::Environment;
    /// # let mut env = Environment::new();
    /// # env.add_test("even", |x: i32| x % 2 == 0);
    /// # let tmpl = env.template_from_str("").unwrap();
    /// # let mut state = tmpl.new_state();
    /// let rv = state.perform_test("even", &[42i32.into()]).unwrap();
    /// assert!(rv);
    /// ```
    pub fn perform_test(&mut self, test: &str, args: &[Value]) -> Result<bool, Error> {
        match self.env().get_test(test) {
            Some(test) => test.call(self, args).map(|x| x.is_true()),
            None => Err(Error::from(ErrorKind::UnknownTest)),
        }
    }

    /// Formats a value to a string using the formatter on the environment.
    ///
    /// ```
    /// # use minijinja::{value::Value, Environment};
    /// # let mut env = Environment::new();
    /// # let tmpl = env.template_from_str("").unwrap();
    /// # let mut state = tmpl.new_state();
    /// let rv = state.format(Value::from(42)).unwrap();
    /// assert_eq!(rv, "42");
    /// ```
    pub fn format(&mut self, value: Value) -> Result<String, Error> {
        let mut rv = String::new();
        let mut out = Output::new(&mut rv);
        self.env().format(&value, self, &mut out).map(|_| rv)
    }

    /// Returns the fuel levels.
    ///
    /// When the fuel feature is enabled, during evaluation the template will keep
    /// track of how much fuel it has consumed.  If the fuel tracker is turned on
    /// the returned value will be `Some((consumed, remaining))`.  If fuel tracking
    /// is not enabled, `None` is returned instead.
    #[cfg(feature = "fuel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fuel")))]
    pub fn fuel_levels(&self) -> Option<(u64, u64)> {
        self.fuel_tracker
            .as_ref()
            .map(|x| (x.consumed(), x.remaining()))
    }

    /// Consumes fuel.
    ///
    /// Custom filters, functions and methods can use this to account for
    /// expensive work they perform on behalf of a template.  The engine
    /// already charges for the size of the value they return, but not for the
    /// work that went into producing it.
    ///
    /// If this runs out of fuel, an `OutOfFuel` error is returned and the
    /// rendering will fail.  If fuel tracking is not enabled or the `fuel`
    /// feature is turned off, this does nothing.
    ///
    /// ```
    /// # use minijinja::{Environment, State, Error};
    /// fn expensive(state: &State, n: u64) -> Result<u64, Error> {
    ///     state.consume_fuel(n)?;
    ///     Ok((0..n).sum())
    /// }
    /// ```
    #[inline]
    pub fn consume_fuel(&self, fuel: u64) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(fuel.saturating_mul(crate::vm::fuel::UNITS_PER_FUEL));
            }
        }
        let _ = fuel;
        Ok(())
    }

    /// Returns the fuel tracker if fuel is tracked.
    #[cfg(feature = "fuel")]
    #[inline(always)]
    pub(crate) fn fuel_tracker(&self) -> Option<&FuelTracker> {
        self.fuel_tracker.as_deref()
    }

    /// Charges fuel in internal units.
    #[inline(always)]
    pub(crate) fn charge_fuel(&self, _units: u64) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(_units);
            }
        }
        Ok(())
    }

    /// Checks that some fuel (in internal units) would still be available.
    ///
    /// This is used before allocating something of a known size.
    #[cfg(feature = "fuel")]
    #[inline(always)]
    pub(crate) fn ensure_fuel(&self, units: u64) -> Result<(), Error> {
        if let Some(ref tracker) = self.fuel_tracker {
            return tracker.ensure(units);
        }
        Ok(())
    }

    /// Charges fuel for the size of a value.
    #[inline(always)]
    pub(crate) fn charge_value(&self, _value: &Value) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(crate::vm::fuel::value_cost(_value));
            }
        }
        Ok(())
    }

    /// Wraps an iterator so that it charges fuel for every item.
    ///
    /// When the fuel runs out the iterator yields an invalid value with the
    /// error and ends.
    #[cfg(feature = "fuel")]
    #[inline(always)]
    pub(crate) fn fuel_iter<I: Iterator<Item = Value>>(
        &self,
        iter: I,
    ) -> crate::vm::fuel::FuelIter<'_, I> {
        crate::vm::fuel::FuelIter::new(self.fuel_tracker.as_deref(), iter)
    }

    /// Wraps an iterator so that it charges fuel for every item.
    #[cfg(not(feature = "fuel"))]
    #[inline(always)]
    pub(crate) fn fuel_iter<I: Iterator<Item = Value>>(&self, iter: I) -> I {
        iter
    }

    /// Looks up a temp and returns it.
    ///
    /// Temps are similar to context values but the engine never looks them up
    /// on their own and they are not scoped.  The lifetime of temps is limited
    /// to the rendering process of a template.  Temps are useful so that
    /// filters and other things can temporarily stash away state without having
    /// to resort to thread locals which are hard to manage.  Unlike context
    /// variables, temps can also be modified during evaluation by filters and
    /// functions.
    ///
    /// Temps are useful for dynamically named data that needs to be represented
    /// as a [`Value`].  For ordinary typed Rust state, prefer
    /// [`get_or_insert_extension`](Self::get_or_insert_extension), which avoids
    /// object wrappers and interior mutability.
    ///
    /// # Example
    ///
    /// ```
    /// use minijinja::{Value, State};
    ///
    /// fn inc(state: &mut State) -> Value {
    ///     let old = state
    ///         .get_temp("my_counter")
    ///         .unwrap_or_else(|| Value::from(0i64));
    ///     let new = Value::from(i64::try_from(old).unwrap() + 1);
    ///     state.set_temp("my_counter", new.clone());
    ///     new
    /// }
    /// ```
    pub fn get_temp(&self, name: &str) -> Option<Value> {
        self.temps.get(name).cloned()
    }

    /// Inserts a temp and returns the old temp.
    ///
    /// For more information see [`get_temp`](Self::get_temp).
    pub fn set_temp(&mut self, name: &str, value: Value) -> Option<Value> {
        self.temps.insert(name.to_owned().into(), value)
    }

    /// Returns a reference to a typed render-local extension.
    ///
    /// Extensions are similar to [`temps`](Self::get_temp), but store ordinary
    /// Rust values keyed by their type.  They are useful for state that should
    /// be shared by filters and functions for the duration of a render without
    /// requiring a [`Value`], [`crate::value::Object`], or interior mutability.
    /// There can be one extension of each concrete type; use a newtype when independent
    /// values have the same underlying type.  Extension values must be `Send`
    /// because states can be moved between threads.
    ///
    /// Extensions are preserved across nested evaluation, including includes,
    /// blocks, and macro calls.  They are dropped together with the state.
    pub fn get_extension<T>(&self) -> Option<&T>
    where
        T: Send + 'static,
    {
        self.extensions
            .get(&TypeId::of::<T>())
            .and_then(|value| value.downcast_ref())
    }

    /// Returns a mutable reference to a typed render-local extension.
    ///
    /// For more information see [`get_extension`](Self::get_extension).
    pub fn get_extension_mut<T>(&mut self) -> Option<&mut T>
    where
        T: Send + 'static,
    {
        self.extensions
            .get_mut(&TypeId::of::<T>())
            .and_then(|value| value.downcast_mut())
    }

    /// Returns a mutable extension, inserting it if necessary.
    ///
    /// If an extension of type `T` is already present, `value` is not inserted.
    /// Extensions require mutable state so that stored values do not need a
    /// mutex or other interior mutability.
    ///
    /// # Example
    ///
    /// ```
    /// use minijinja::State;
    ///
    /// #[derive(Default)]
    /// struct Counter(usize);
    ///
    /// fn next(state: &mut State) -> usize {
    ///     let counter = state.get_or_insert_extension(Counter::default());
    ///     counter.0 += 1;
    ///     counter.0
    /// }
    /// ```
    pub fn get_or_insert_extension<T>(&mut self, value: T) -> &mut T
    where
        T: Send + 'static,
    {
        self.get_or_insert_extension_with(|| value)
    }

    /// Returns a mutable extension, inserting one from `f` if necessary.
    ///
    /// For more information see [`get_or_insert_extension`](Self::get_or_insert_extension).
    pub fn get_or_insert_extension_with<T, F>(&mut self, f: F) -> &mut T
    where
        T: Send + 'static,
        F: FnOnce() -> T,
    {
        self.extensions
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Box::new(f()))
            .downcast_mut()
            .expect("extension had an unexpected type")
    }

    /// Creates an origin for an undefined value created at `pc` of the
    /// current instructions and remembers the instructions for later
    /// resolution.
    #[cfg(feature = "debug")]
    #[cold]
    pub(crate) fn make_undefined_origin(&mut self, pc: u32) -> crate::value::UndefinedOrigin {
        let instructions = self.instructions;
        let instructions_id = instructions.id();
        self.undefined_origins
            .entry(instructions_id)
            .or_insert(instructions);
        crate::value::UndefinedOrigin {
            instructions_id,
            pc,
        }
    }

    #[cfg(feature = "debug")]
    pub(crate) fn make_debug_info(
        &self,
        pc: u32,
        instructions: &Instructions<'_>,
    ) -> crate::debug::DebugInfo {
        let mut referenced_locals = BTreeMap::new();
        for name in instructions.get_referenced_names(pc) {
            if let Some(value) = self.lookup(name) {
                referenced_locals.insert(name.to_string(), value);
            }
        }
        crate::debug::DebugInfo {
            template_source: Some(instructions.source().to_string()),
            referenced_locals,
        }
    }
}

/// Fuel helpers for the built-in filters, functions and tests.
#[cfg_attr(not(feature = "builtins"), allow(dead_code))]
impl State<'_, '_> {
    /// Charges fuel for visiting `n` items.
    #[inline(always)]
    pub(crate) fn charge_items(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(crate::vm::fuel::cost_of(_n, crate::vm::fuel::ITEM_COST));
            }
        }
        Ok(())
    }

    /// Charges fuel for a call to a filter or test made on behalf of a
    /// built-in filter.  This is charged like the call from a template:
    /// one instruction plus the string the call works on.
    #[inline(always)]
    pub(crate) fn charge_call(&self, _args: &[Value]) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                let input = _args
                    .first()
                    .and_then(|x| x.as_str())
                    .map_or(0, |x| x.len());
                return tracker.consume(
                    crate::vm::fuel::INSTRUCTION_COST.saturating_add(crate::vm::fuel::cost_of(
                        input,
                        crate::vm::fuel::BYTE_COST,
                    )),
                );
            }
        }
        Ok(())
    }

    /// Charges fuel for looking up an item in a sorted collection of `n`
    /// items.
    #[inline(always)]
    pub(crate) fn charge_lookup(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(crate::vm::fuel::lookup_cost(_n));
            }
        }
        Ok(())
    }

    /// Charges the extra fuel for serializing a value into `n` bytes.
    ///
    /// The engine already charges for the bytes of the resulting string, this
    /// charges for the extra work of walking the value.
    #[inline(always)]
    pub(crate) fn charge_serialized(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            use crate::vm::fuel::{cost_of, BYTE_COST, SERIALIZED_BYTE_COST};
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(cost_of(_n, SERIALIZED_BYTE_COST - BYTE_COST));
            }
        }
        Ok(())
    }

    /// Charges fuel for one format specifier of the `format` filter.
    #[inline(always)]
    pub(crate) fn charge_format_spec(&self) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(crate::vm::fuel::FORMAT_SPEC_COST);
            }
        }
        Ok(())
    }

    /// Charges fuel for sorting `n` items.
    #[inline(always)]
    pub(crate) fn charge_sort(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.consume(crate::vm::fuel::sort_cost(_n));
            }
        }
        Ok(())
    }

    /// Checks that `n` bytes could still be paid for.
    #[inline(always)]
    pub(crate) fn ensure_bytes(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.ensure(crate::vm::fuel::cost_of(_n, crate::vm::fuel::BYTE_COST));
            }
        }
        Ok(())
    }

    /// Like [`ensure_bytes`](Self::ensure_bytes) but does not exhaust the
    /// fuel if the check fails.
    #[inline(always)]
    pub(crate) fn ensure_bytes_quiet(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                if tracker.remaining_units()
                    <= crate::vm::fuel::cost_of(_n, crate::vm::fuel::BYTE_COST)
                {
                    return Err(Error::from(crate::ErrorKind::OutOfFuel));
                }
            }
        }
        Ok(())
    }

    /// Checks that `n` list slots could still be paid for.
    #[inline(always)]
    pub(crate) fn ensure_slots(&self, _n: usize) -> Result<(), Error> {
        #[cfg(feature = "fuel")]
        {
            if let Some(ref tracker) = self.fuel_tracker {
                return tracker.ensure(crate::vm::fuel::cost_of(_n, crate::vm::fuel::SLOT_COST));
            }
        }
        Ok(())
    }

    /// Like [`fuel_iter`](Self::fuel_iter) but with an optional state.
    #[cfg(feature = "fuel")]
    #[inline(always)]
    pub(crate) fn opt_fuel_iter<'a, I: Iterator<Item = Value>>(
        state: Option<&'a State>,
        iter: I,
    ) -> crate::vm::fuel::FuelIter<'a, I> {
        crate::vm::fuel::FuelIter::new(state.and_then(|x| x.fuel_tracker.as_deref()), iter)
    }

    /// Like [`fuel_iter`](Self::fuel_iter) but with an optional state.
    #[cfg(not(feature = "fuel"))]
    #[inline(always)]
    pub(crate) fn opt_fuel_iter<I: Iterator<Item = Value>>(_state: Option<&State>, iter: I) -> I {
        iter
    }
}

impl<'a> ArgType<'a> for &State<'_, '_> {
    type Output = &'a State<'a, 'a>;

    fn from_value(_value: Option<&'a Value>) -> Result<Self::Output, Error> {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            "cannot use state type in this position",
        ))
    }

    fn from_state_and_value(
        state: Option<&'a State>,
        _value: Option<&'a Value>,
    ) -> Result<(Self::Output, usize), Error> {
        match state {
            None => Err(Error::new(ErrorKind::InvalidOperation, "state unavailable")),
            Some(state) => Ok((state, 0)),
        }
    }
}

#[cfg(all(feature = "macros", feature = "multi_template"))]
struct BlockCheckpoint<'env> {
    name: &'env str,
    instruction_count: usize,
    depth: usize,
}

#[cfg(feature = "multi_template")]
enum SavedBlockState<'template, 'env> {
    #[cfg(feature = "macros")]
    Isolated(Vec<BlockCheckpoint<'env>>, BTreeSet<&'env str>),
    Replaced(
        BTreeMap<&'env str, BlockStack<'template, 'env>>,
        BTreeSet<&'env str>,
    ),
}

#[cfg(feature = "multi_template")]
pub(crate) enum BlockState<'template, 'env> {
    Keep,
    #[cfg(feature = "macros")]
    Isolate,
    Replace(BTreeMap<&'env str, BlockStack<'template, 'env>>),
}

/// Tracks a block and its parents for super.
#[cfg(feature = "multi_template")]
#[derive(Default)]
pub(crate) struct BlockStack<'template, 'env> {
    instructions: Vec<&'template Instructions<'env>>,
    depth: usize,
}

#[cfg(feature = "multi_template")]
impl<'template, 'env> BlockStack<'template, 'env> {
    pub fn new(instructions: &'template Instructions<'env>) -> BlockStack<'template, 'env> {
        BlockStack {
            instructions: vec![instructions],
            depth: 0,
        }
    }

    pub fn instructions(&self) -> &'template Instructions<'env> {
        self.instructions.get(self.depth).copied().unwrap()
    }

    pub fn len(&self) -> usize {
        self.instructions.len()
    }

    pub fn push(&mut self) -> bool {
        if self.depth + 1 < self.instructions.len() {
            self.depth += 1;
            true
        } else {
            false
        }
    }

    #[track_caller]
    pub fn pop(&mut self) {
        self.depth = self.depth.checked_sub(1).unwrap()
    }

    pub fn append_instructions(&mut self, instructions: &'template Instructions<'env>) {
        self.instructions.push(instructions);
    }
}
