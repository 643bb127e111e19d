// A minimal chat page on converger, built on the AI SDK's own React binding (useChat from
// @ai-sdk/react, with the `ai` package's DefaultChatTransport): send, stream, stop, and resume
// after a reload. The browser tests drive it (tests/frontends.rs); tests/frontends/build.mjs
// bundles it into tests/frontends/dist/. Served from another origin than the node's, every
// request here is a cross-origin one (CORS preflights included: the Authorization header is not
// CORS-safelisted), so the node must list the page's origin in `frontends.allow_origins`.
//
// Query string: ?base=<node URL>&token=<conversation-scope token>&conversation=<conversation id>
//
// What the test reads:
//   - one element per message, `.message[data-role][data-id]`, its text in a child `.text`;
//   - `#status`: useChat's status (submitted | streaming | ready | error), or `loading` while the
//     history is fetched, `load-error` if that failed;
//   - `#error`: the last error's message, if any;
//   - `window.chatState = {status, messages, error, lastStop}`, refreshed after every render.
// What the test drives: `#input` + `#send`, and `#stop`.

import { useChat } from '@ai-sdk/react';
import { DefaultChatTransport } from 'ai';
import { useEffect, useLayoutEffect, useMemo, useRef, useState } from 'react';
import { createRoot } from 'react-dom/client';

const query = new URLSearchParams(window.location.search);
const BASE = (query.get('base') ?? '').replace(/\/+$/, '');
const TOKEN = query.get('token') ?? '';
const CONVERSATION = query.get('conversation') ?? '';

const API = `${BASE}/api/v1/ai-sdk/chat`;
const CHAT_URL = `${API}/${encodeURIComponent(CONVERSATION)}`;
const AUTHORIZATION = { Authorization: `Bearer ${TOKEN}` };

// The text a message shows: its text parts, joined (tool and data parts are not rendered).
function textOf(message) {
    return message.parts
        .filter((part) => part.type === 'text')
        .map((part) => part.text)
        .join('');
}

// Publishes what the page shows for the test. In a layout effect, i.e. after React has committed
// the render to the DOM, so that window.chatState never runs ahead of what is on screen. `null`
// publishes nothing: a parent's layout effect runs after its child's, so App must stay quiet once
// Chat is the one on screen.
function usePublish(state) {
    useLayoutEffect(() => {
        if (state !== null) window.chatState = state;
    });
}

// The history is fetched BEFORE useChat is mounted: useChat creates its Chat once per chat id and
// takes `messages` only at that moment, so the history must be there on the first render.
function App() {
    const [history, setHistory] = useState(null);
    const [loadError, setLoadError] = useState(null);

    useEffect(() => {
        fetch(`${CHAT_URL}/messages`, { headers: AUTHORIZATION })
            .then(async (response) => {
                if (!response.ok) throw new Error(`${response.status}: ${await response.text()}`);
                return response.json();
            })
            .then(setHistory, (error) => setLoadError(String(error?.message ?? error)));
    }, []);

    const status = loadError !== null ? 'load-error' : 'loading';
    usePublish(history === null ? { status, messages: [], error: loadError, lastStop: null } : null);
    if (history === null) {
        return (
            <main>
                <p id="status">{status}</p>
                {loadError !== null && <p id="error">{loadError}</p>}
            </main>
        );
    }
    return <Chat history={history} />;
}

function Chat({ history }) {
    // Made once: a new transport per render would be harmless to useChat (it reads the latest)
    // but pointless.
    const transport = useMemo(() => new DefaultChatTransport({ api: API, headers: AUTHORIZATION }), []);
    // resume: on mount, useChat asks GET {api}/{id}/stream for an answer in progress (the node
    // answers 204 when there is none) and, if there is one, replays it from its `start` chunk into
    // the last assistant message (DefaultChatTransport's resumeStreamIsReplay defaults to true).
    const { messages, status, error, sendMessage, stop } = useChat({
        id: CONVERSATION,
        messages: history,
        transport,
        resume: true,
    });
    const [lastStop, setLastStop] = useState(null);
    const input = useRef(null);

    usePublish({ status, messages, error: error ? error.message : null, lastStop });

    function send(event) {
        event.preventDefault();
        const text = input.current.value;
        if (text === '') return;
        input.current.value = '';
        sendMessage({ text });
    }

    // Stop has two halves, and the page needs both. useChat's stop() only aborts the local fetch:
    // the node would go on generating (and committing) the answer, which a reload or another tab
    // would then show whole. POST …/stop is what stops the answer on the node. It goes first, so
    // the node cuts the answer at a definite point; useChat's stop() then ends the local request at
    // once instead of waiting for the node's `abort` chunk, which is what a user pressing stop
    // expects. Either way the partial text already streamed stays on screen.
    async function stopAnswer() {
        try {
            const response = await fetch(`${CHAT_URL}/stop`, {
                method: 'POST',
                headers: { ...AUTHORIZATION, 'Content-Type': 'application/json' },
                body: '{}',
            });
            setLastStop({ status: response.status, body: await response.json().catch(() => null) });
        } catch (failure) {
            setLastStop({ status: null, body: String(failure?.message ?? failure) });
        }
        await stop();
    }

    return (
        <main>
            <p id="status">{status}</p>
            {error && <p id="error">{error.message}</p>}
            <ol id="messages">
                {messages.map((message) => (
                    <li key={message.id} className="message" data-role={message.role} data-id={message.id}>
                        <span className="text">{textOf(message)}</span>
                    </li>
                ))}
            </ol>
            <form onSubmit={send}>
                <input id="input" ref={input} autoComplete="off" />
                <button id="send" type="submit">
                    Send
                </button>
                <button id="stop" type="button" onClick={stopAnswer}>
                    Stop
                </button>
            </form>
        </main>
    );
}

createRoot(document.getElementById('root')).render(<App />);
